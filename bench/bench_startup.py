"""Start-up: wall time of ``wantrain --help`` and ``wantrain check examples/quickstart.toml`` (fresh processes),
and the seconds a fresh ``wantrain run examples/quickstart.toml`` takes to print its first line on stdout or stderr
(the process is killed then, before it reads the config).

Not a test. Each command runs ``--repeats`` times as ``python -m wantrain.cli.main ...`` from the repository root;
the median and the range are printed as JSON, with the heavy libraries each command imported (``-X importtime``
of one extra run: torch, diffusers, transformers, tensorboardX).

    python bench/bench_startup.py
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "tensorboardX", "peft", "matplotlib", "numpy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    commands = {"wantrain --help": ["--help"], "wantrain check examples/quickstart.toml":
                ["check", "examples/quickstart.toml"]}
    out = {}
    for label, cli_args in commands.items():
        cmd = [sys.executable, "-m", "wantrain.cli.main", *cli_args]
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            times.append(time.perf_counter() - start)
        imported = subprocess.run([sys.executable, "-X", "importtime", *cmd[1:]], cwd=ROOT, env=env,
                                  capture_output=True, text=True).stderr
        top = {line.rsplit("|", 1)[-1].strip() for line in imported.splitlines() if "|" in line}
        out[label] = {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
                      "max_s": round(max(times), 3), "heavy_imports": [m for m in HEAVY if m in top]}
    first = [first_output_s([sys.executable, "-m", "wantrain.cli.main", "run", "examples/quickstart.toml"], env)
             for _ in range(args.repeats)]
    out["wantrain run: first line"] = {"median_s": round(statistics.median(first), 3), "min_s": round(min(first), 3),
                                       "max_s": round(max(first), 3)}
    print(json.dumps(out, indent=1))
    return 0


def first_output_s(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from the start of ``cmd`` to its first byte on stdout or stderr; the process is killed then."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout, proc.stderr], [], [], 300)
        return time.perf_counter() - start if ready else float("inf")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
