"""What measuring the samples' motion costs, as a share of a sampling round (docs/validation.md, Motion).

Runs the quickstart (tiny T2V twin, one 64x64 9-frame sample with 8 denoising steps) for a few steps with a sampling
round at every step and [validation] off, then reads the run log: each ``samples_written`` event holds the round's
``seconds`` and, of them, ``motion_seconds`` (OpenCV's optical flow over the 8 frame pairs). Prints each round's
share and the median share (the acceptance: at most 5 %), plus the one-off ``clip_motion`` measurement's time.

    python bench/bench_motion.py [--steps 6] [--frames 9] [--size 64]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()

    from wantrain.app.assemble import prepare
    from wantrain.app.config import load_config
    from wantrain.observers.evaluation.motion import clip_motion

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                        ignore=shutil.ignore_patterns(".wantrain_cache"))
        text = (ROOT / "examples" / "quickstart.toml").read_text().replace('"../runs"', '"runs"')
        text = re.sub(r"(\[validation\][^\n]*\nenabled = )true", r"\1false", text)
        config = tmp / "quickstart.toml"
        config.write_text(text)
        overrides = [f"train.max_steps={args.steps}", "sample.every=1", f"sample.frames={args.frames}",
                     f"sample.width={args.size}", f"sample.height={args.size}", "observers.progress=false",
                     "observers.tensorboard=false"]
        outcome = prepare(load_config(config, overrides)).execute()
        log = [json.loads(x) for x in (outcome.run_dir / "log.jsonl").read_text().splitlines()]
    rounds = [x for x in log if x["event"] == "samples_written"]
    shares = [r["motion_seconds"] / r["seconds"] for r in rounds]
    for r, share in zip(rounds, shares, strict=True):
        print(f"step {r['step']:>3}: round {r['seconds']:.3f} s, motion {r['motion_seconds'] * 1000:.1f} ms "
              f"({share:.2%})")
    print(f"median share of a sampling round: {statistics.median(shares):.2%} over {len(shares)} rounds "
          f"({args.size}x{args.size}, {args.frames} frames)")
    import numpy as np

    clip = np.random.default_rng(0).integers(0, 255, (args.frames, args.size, args.size, 3), dtype=np.uint8)
    started = time.perf_counter()
    clip_motion([clip] * 5)  # the quickstart's 5 clips, measured once before training
    print(f"once per run: the training clips' motion, 5 clips: {(time.perf_counter() - started) * 1000:.1f} ms "
          "(decoding excluded)")


if __name__ == "__main__":
    main()
