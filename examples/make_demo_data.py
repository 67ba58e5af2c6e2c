"""Regenerate examples/demo_data: 16 short clips of moving shapes and 4 images, each with a caption.

    python examples/make_demo_data.py [--out examples/demo_data] [--seed 0]

Deterministic from the seed (logic in wantrain/data/demo.py).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from wantrain.data.demo import make_demo_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo_data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--images", type=int, default=4)
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    paths = make_demo_dataset(args.out, seed=args.seed, clips=args.clips, images=args.images)
    total = sum(p.stat().st_size + p.with_suffix(".txt").stat().st_size for p in paths)
    print(f"wrote {len(paths)} media files to {args.out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
