"""Download the wheels the GPU acceptance machine lacks into ``.whl/`` (git-ignored), so that a run can carry them.

The machine lent for acceptance runs (one H200, CPython 3.12, torch with CUDA, numpy; no package registry reachable)
lacks the packages in :data:`MISSING`. This script downloads exactly those wheels, at the versions installed here
(``importlib.metadata``), for CPython 3.12 manylinux x86-64, without their dependencies (the machine has the rest),
and checks that the folder stays under the 64 MiB a run may carry. bench/README.md ("GPU acceptance run") says how
to carry and install them.

    python bench/fetch_wheels.py --dry-run     # the pip command and the pins, nothing downloaded
    python bench/fetch_wheels.py               # into .whl/ (needs the package index)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What wantrain imports that the acceptance machine does not have (issue 33), plus ftfy's one dependency.
MISSING = ("diffusers", "structlog", "tensorboardX", "av", "ftfy", "wcwidth", "orjson", "cattrs", "tomli-w",
           "crc32c")
CARRY_LIMIT = 64 * 2**20  # what the device tool carries in all
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def pins() -> list[str]:
    """``name==version`` of every package in :data:`MISSING` as installed here (the versions the tests pass with)."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in MISSING]


def command(folder: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--abi", "cp312", *platforms, "--dest", str(folder), *pins()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--dry-run", action="store_true", help="print the command; download nothing")
    args = parser.parse_args(argv)
    cmd = command(args.dest)
    print(shlex.join(cmd))
    if args.dry_run:
        return 0
    args.dest.mkdir(exist_ok=True)
    subprocess.run(cmd, check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    lacking = [n for n in MISSING if n.lower().replace("_", "-") not in names]
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    if lacking:
        print(f"error: no wheel for {', '.join(lacking)}", file=sys.stderr)
        return 1
    if total > CARRY_LIMIT:
        print(f"error: {total / 2**20:.1f} MiB is over the {CARRY_LIMIT / 2**20:.0f} MiB a run carries",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
