"""``wantrain prepare`` on 1080p footage: seconds of work per minute of footage for the scene cuts and the clipping.

    python bench/bench_prepare.py [--seconds 60] [--fps 24] [--max-side 0] [--cores 2]

Writes a synthetic 1920x1080 H.264 video (smooth textures drifting across the frame, a moving disc, a hard cut
every 4-7 s: the content detector's workload and an encoder's), then times the content detector's pass alone
(``detect_cuts``) and a whole ``prepare_folder`` run (cuts, then clips on the frame buckets ``[33, 81]`` at 16 fps,
the A14B rate); the clipping is the difference. Pinned to ``--cores`` CPUs. Prints one JSON line:
footage minutes, the wall and CPU seconds of each phase, and each per minute of footage (``--max-side 832`` measures the
clips shrunk on the way, as a user training at 480p would). Figures go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from wantrain.data.prepare import PrepareSettings, prepare_folder
from wantrain.data.prepare_scenes import DetectorSettings, detect_cuts
from wantrain.data.prepare_write import EncodeSettings


def write_footage(path: Path, seconds: float, fps: float, seed: int = 0) -> list[int]:
    """A 1080p H.264 video of ``seconds`` with hard cuts every 4-7 s; returns the cut frames."""
    import av

    rng = np.random.default_rng(seed)
    total = int(seconds * fps)
    cuts, at = [], 0
    while True:
        at += int(rng.uniform(4, 7) * fps)
        if at >= total:
            break
        cuts.append(at)
    bounds = [0, *cuts, total]
    rate = Fraction(fps).limit_denominator(1001)
    yy, xx = np.mgrid[-120:120, -120:120]
    disc = xx ** 2 + yy ** 2 < 120 ** 2
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast", "crf": "20"}
        index = 0
        for a, b in zip(bounds[:-1], bounds[1:]):
            small = rng.integers(0, 256, (18, 32, 3), dtype=np.uint8)  # a smooth texture, drifting without a jump
            texture = np.asarray(Image.fromarray(small).resize((1920 + 3 * (b - a), 1080 + 2 * (b - a)),
                                                               Image.Resampling.BICUBIC))
            colour = rng.integers(0, 256, 3)
            for t in range(b - a):
                dx, dy = 3 * t, 2 * t
                frame = texture[dy:dy + 1080, dx:dx + 1920].copy()
                cx, cy = 300 + 8 * t, 540
                frame[cy - 120:cy + 120, cx - 120:cx + 120][disc] = colour
                picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
                picture.pts = index
                picture.time_base = 1 / rate
                index += 1
                for packet in stream.encode(picture):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return cuts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="footage length (default 60)")
    parser.add_argument("--fps", type=float, default=24.0)
    parser.add_argument("--max-side", type=int, default=0, help="shrink clips to this longer side (0: keep 1080p)")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cores]))
    root = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        (root / "raw").mkdir()
        start = time.perf_counter()
        footage = root / "raw" / "footage.mp4"
        cuts = write_footage(footage, args.seconds, args.fps)
        made = time.perf_counter() - start
        start, cpu = time.perf_counter(), time.process_time()
        detection = detect_cuts(footage, args.fps, DetectorSettings())
        detecting, detecting_cpu = time.perf_counter() - start, time.process_time() - cpu
        settings = PrepareSettings(buckets=(33, 81), fps=16.0,
                                   encode=EncodeSettings(max_side=args.max_side or None))
        start, cpu = time.perf_counter(), time.process_time()
        summary = prepare_folder(root / "raw", root / "out", settings, progress=False, log=lambda _: None)
        full, full_cpu = time.perf_counter() - start, time.process_time() - cpu
        minutes = summary.footage_seconds / 60
        print(json.dumps({
            "footage_min": round(minutes, 3), "resolution": "1920x1080", "source_fps": args.fps,
            "max_side": args.max_side or None, "cores": len(os.sched_getaffinity(0)), "cuts_made": len(cuts),
            "cuts_found_exactly": list(detection.cuts) == cuts, "scenes": summary.scenes,
            "clips": len(summary.written), "make_footage_s": round(made, 1), "cuts_only_s": round(detecting, 1),
            "cuts_and_clips_s": round(full, 1),
            "cuts_and_clips_s_per_footage_min": round(full / minutes, 1),
            "cuts_s_per_footage_min": round(detecting / minutes, 1),
            "clips_s_per_footage_min": round((full - detecting) / minutes, 1),
            "hour_of_footage_min": round(60 * full / minutes / 60, 1),
            # CPU seconds (all threads): steadier than wall time on a shared machine; / cores = wall time when idle
            "cpu_s_per_footage_min": round(full_cpu / minutes, 1),
            "cuts_cpu_s_per_footage_min": round(detecting_cpu / minutes, 1),
            "load_average": round(os.getloadavg()[0], 1),
        }))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
