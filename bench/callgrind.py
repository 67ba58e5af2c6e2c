"""Instruction counts under valgrind's callgrind, for the bench scripts (bench_overhead.py, bench_bus.py).

A script re-runs itself as a child under ``valgrind --tool=callgrind --instr-atstart=no`` (:func:`run_counted`);
the child switches counting on around what it measures and takes a named dump of each part (:class:`Control`);
the parent reads each dump's total back. One thread and a fixed hash seed (dict and set layouts, and so their
probe counts, are the same in every process), so a count repeats to within about 0.15 % between processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run_counted(script: str | Path, argv: list[str], keep: str | None = None) -> dict[str, int]:
    """Run ``python script *argv`` under callgrind in a scratch directory (the repository first on the path) and
    return {dump name: instructions} for every dump the child took. ``keep``: copy the dumps there (for
    ``callgrind_annotate``: where the instructions go, function by function)."""
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(
            [str(Path(script).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
        # sys.executable itself (not a shell shim): valgrind does not follow exec without --trace-children
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", sys.executable, str(Path(script).resolve()),
               *argv]
        subprocess.run(cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for dump in Path(work).glob("callgrind.out.*"):
                shutil.copy(dump, Path(keep) / dump.name)
        counts: dict[str, int] = {}
        for dump in Path(work).glob("callgrind.out.*"):
            text = dump.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: dump (\S+)$", text, re.M)
            total = re.search(r"^summary: (\d+)", text, re.M)
            if trigger and total:
                counts[trigger[1]] = int(total[1])
    return counts


class Control:
    """In the child: ``control("-i", "on")`` switches counting on, ``control("-z")`` zeroes the counters,
    ``control("-d", name)`` dumps them under ``name`` (``callgrind_control`` on this process)."""

    def __init__(self) -> None:
        self.pid = str(os.getpid())

    def __call__(self, *what: str) -> None:
        subprocess.run(["callgrind_control", *what, self.pid], check=True, stdout=subprocess.DEVNULL)
