"""Data pipeline benchmark: probe, decode + resize, encode + cache, cached reads, and bucket waste.

    python bench/bench_data.py [--clips 200] [--seed 0] [--threads 1]
    python bench/bench_data.py --decode-16k [--frames 5] [--codec mjpeg]

``--decode-16k`` writes one 15360x8640 clip and decodes it into an 832x480 bucket twice, each in a fresh process:
the way decoding worked before (every frame converted to a full-size RGB picture, then resized by Pillow) and the
way it works now (``decode_video``: FFmpeg's scaler shrinks while it converts). Prints the peak RSS (the process's
``ru_maxrss``, less its peak before decoding) and the wall time of each.

Generates a corpus of moving-shape clips of varied aspect ratio, length and frame rate into a temporary folder,
then times each stage on the CPU with a fake encoder (8x spatial average pool, every 4th frame; a real VAE's cost
is the model's, not the data pipeline's). Prints one table; figures go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from wantrain.data import build_dataset, ensure_cache
from wantrain.data.config import DataConfig
from wantrain.data.demo import make_demo_dataset
from wantrain.models.wan22.variants import variant_spec


class PoolEncoders:
    encoder_identity = "bench-pool-v1"

    def __init__(self) -> None:
        self.media_calls = self.text_calls = 0

    def encode_media(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.media_calls += 1
        return {"latents": torch.nn.functional.avg_pool3d(pixels, (1, 8, 8))[:, :, ::4].contiguous()}

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        self.text_calls += 1
        return {"text_embeds": torch.zeros(len(captions), 16, 32)}


SIZES = ((160, 96), (128, 128), (96, 160), (192, 108), (144, 96), (120, 160), (176, 96), (112, 112))


DECODE_CHILD = """
import json, sys, time
from pathlib import Path
from wantrain.data.media import decode_video, fit, upright
import av
path, way, frames = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def high_water_mb():  # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, kept across exec)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024
before = high_water_mb()
t = time.perf_counter()
if way == "before":  # the old decode: a full-size RGB picture per frame, resized by Pillow
    out = []
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in c.decode(stream):
            out.append(fit(upright(frame.to_image(), 0), 832, 480))
    n = len(out)
else:
    n = len(decode_video(path, list(range(frames)), 832, 480).frames)
seconds = time.perf_counter() - t
peak = high_water_mb()
print(json.dumps({"frames": n, "seconds": seconds, "peak_rss_mb": peak, "decode_rss_mb": peak - before}))
"""


def decode_16k(frames: int, codec: str) -> None:
    import av
    import numpy as np

    width, height = 15360, 8640
    with tempfile.TemporaryDirectory(prefix="wantrain_bench_16k_") as tmp:
        path = Path(tmp) / f"16k_{codec}.mkv"
        t = time.perf_counter()
        with av.open(str(path), "w") as container:
            stream = container.add_stream(codec, rate=16)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
            picture = np.zeros((height, width, 3), np.uint8)
            picture[::64] = 255
            for i in range(frames):
                frame = av.VideoFrame.from_ndarray(np.roll(picture, 8 * i, axis=1), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        print(f"source: {width}x{height}, {frames} frames, {codec}, {path.stat().st_size / 2**20:.1f} MiB "
              f"(written in {time.perf_counter() - t:.1f} s); target 832x480")
        print(f"{'decode':<44} {'peak RSS MiB':>12} {'of it decoding':>14} {'time s':>7}")
        for way, label in (("before", "full-size RGB + Pillow resize (before)"),
                           ("after", "decode_video: scaled by FFmpeg (after)")):
            done = subprocess.run([sys.executable, "-c", DECODE_CHILD, str(path), way, str(frames)],
                                  capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{label:<44} {r['peak_rss_mb']:>12.0f} {r['decode_rss_mb']:>14.0f} {r['seconds']:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the decode uses PyAV's own)")
    parser.add_argument("--decode-16k", action="store_true", help="peak RSS and time of decoding one 16K clip")
    parser.add_argument("--frames", type=int, default=5, help="--decode-16k: frames of the clip")
    parser.add_argument("--codec", default="mjpeg", help="--decode-16k: the clip's codec (mjpeg, libx264, ...)")
    args = parser.parse_args()
    if args.decode_16k:
        decode_16k(args.frames, args.codec)
        return
    torch.set_num_threads(args.threads)
    spec = variant_spec("tiny-t2v")
    with tempfile.TemporaryDirectory(prefix="wantrain_bench_") as tmp:
        root = Path(tmp) / "corpus"
        t = time.perf_counter()
        paths = make_demo_dataset(root, seed=args.seed, clips=args.clips, images=0, sizes=SIZES,
                                  frame_range=(9, 60), fps_choices=(12.0, 16.0, 24.0, 30.0))
        t_gen = time.perf_counter() - t
        corpus_mb = sum(p.stat().st_size for p in paths) / 2**20

        cfg = DataConfig(path=root, resolutions=[128], frames=[9, 17, 33], clip_mode="head")
        t = time.perf_counter()
        data = build_dataset(cfg, spec=spec, seed=args.seed, batch_size=4)
        t_probe = time.perf_counter() - t

        # decode + resize only (raw pixels), one epoch
        t = time.perf_counter()
        frames = 0
        it = data.batches(None)
        for _ in range(data.steps_per_epoch):
            b = next(it)
            frames += b["pixels"].shape[0] * b["pixels"].shape[2]
        t_decode = time.perf_counter() - t

        enc = PoolEncoders()
        t = time.perf_counter()
        stats = ensure_cache(data, enc)
        t_cache = time.perf_counter() - t

        cached = PoolEncoders()
        data2 = build_dataset(cfg, spec=spec, seed=args.seed, batch_size=4)
        t = time.perf_counter()
        it = data2.batches(cached)
        n = 0
        for _ in range(data2.steps_per_epoch):
            n += len(next(it)["paths"])
        t_cached = time.perf_counter() - t

        rep = data.report
        clips = rep.clips
        print(f"corpus: {len(paths)} clips, {corpus_mb:.1f} MiB, sizes {len(SIZES)} ratios, 9-60 frames, "
              f"12/16/24/30 fps (generated in {t_gen:.1f} s)")
        print(f"{'stage':<34} {'time s':>8} {'rate':>22}")
        print(f"{'probe + plan (check)':<34} {t_probe:>8.2f} {len(paths) / t_probe:>14.0f} files/s")
        print(f"{'decode + resize, 1 epoch':<34} {t_decode:>8.2f} {frames / t_decode:>13.0f} frames/s"
              f" ({clips / t_decode:.0f} clips/s)")
        print(f"{'decode + encode + write cache':<34} {t_cache:>8.2f} {stats.latents_encoded / t_cache:>14.0f} clips/s")
        print(f"{'cached epoch (0 encoder calls: ' + str(cached.media_calls + cached.text_calls) + ')':<34} "
              f"{t_cached:>8.2f} {n / t_cached:>13.0f} samples/s")
        print(f"bucket waste: {rep.pixels_cropped_pct:.1f}% pixels cropped, {rep.frames_left_over_pct:.1f}% frames "
              f"left over (head mode), {len(rep.skipped)} files skipped, {len(rep.buckets)} buckets, "
              f"{rep.steps_per_epoch} steps/epoch at batch 4")
        for mode in ("uniform", "slide"):
            other = build_dataset(DataConfig(path=root, resolutions=[128], frames=[9, 17, 33], clip_mode=mode),
                                  spec=spec, seed=args.seed, batch_size=4)
            print(f"  {mode:>7}: {other.report.clips} clips, {other.report.frames_left_over_pct:.1f}% frames left over")


if __name__ == "__main__":
    main()
