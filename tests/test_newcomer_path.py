"""A newcomer's first hour, as commands in a shell (issue 29's acceptance): the README's quickstart run, Ctrl-C and
`--resume auto`, then `check`, `report`, `replay` and the LR finder. None of them may print a traceback or a
warning that is not about the user's own input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import prewarmed
import pytest

from tests.observers.test_lr_finder_doc import doc_output, summary_of
from tests.test_end_to_end import copy_examples

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 15  # the shared run's length: a Ctrl-C at step 5 leaves 10 steps to resume

# bitsandbytes' "Failed to load CPU gemm_4bit_forward" notice is issue 26's (item 10), not this path's
FOREIGN = re.compile(r"Failed to load CPU gemm_4bit_forward")
NOISE = re.compile(r"Traceback|Warning|\[warning|\bwarn\b", re.I)


def wantrain(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m wantrain ARGS`` forked from the prewarmed server: the imports a fresh process would print
    warnings at are checked once, in the first run (a fresh process) and in :func:`prewarmed.server_log`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return prewarmed.run(["-m", "wantrain", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)


# about the user's input: the LR finder's advice names the lr_finder key to change (a short sweep here)
USER_INPUT = re.compile(r"lr_finder\.\w+")


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if NOISE.search(line) and not FOREIGN.search(line) and not USER_INPUT.search(line)]


def test_the_newcomer_path_prints_no_traceback_and_no_warning(tmp_path):
    """One shared run (the quickstart as shipped, shortened with --max-steps) carries the whole path: Ctrl-C at
    its first log step (a fresh process, as the user's shell starts it), the printed `--resume auto` to the end
    (end-of-run validation and samples), then `check`, `report` and `replay` of that run, and a short LR-finder
    sweep (these forked from the prewarmed server, whose import log is checked as well)."""
    config = copy_examples(tmp_path, validation_and_samples=True)  # the quickstart as shipped
    outputs = []

    def ok(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = wantrain(*args, cwd=tmp_path)
        outputs.append((args, done.stdout + done.stderr))
        assert done.returncode == code, (args, done.stderr[-3000:])
        return done

    # the README's run, interrupted with Ctrl-C at its first log step, then the printed --resume auto
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "wantrain", "run", config.name, "--max-steps", f"{STEPS}",
                             "--run-id", "first", "--set", "sample.steps=2"],  # 8 denoising steps: 10 s more CPU
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # the progress line prints at log steps (every 5)
        seen.append(line)
        if line.startswith(f"step 5/{STEPS}"):
            proc.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline
    rest, _ = proc.communicate(timeout=600)
    text = "".join(seen) + rest
    outputs.append((("run", "Ctrl-C"), text))
    assert proc.returncode == 3, text[-3000:]
    resume = re.search(r"continue with: (.*)", text).group(1).split()
    assert resume[:3] == ["wantrain", "run", config.name] and resume[-2:] == ["--resume", "auto"]
    assert "sample.steps=2" in resume  # the same overrides
    ok(*resume[1:])
    (run_dir,) = (tmp_path / "runs").glob("*__first")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == STEPS and any("val/loss" in r for r in rows if r["step"] == STEPS)  # resumed to the end
    assert (run_dir / "samples" / f"step_{STEPS:06d}_00.mp4").exists()

    ok("check", config.name)
    ok("report", str(run_dir), "--out", str(tmp_path / "report.png"))
    ok("replay", str(run_dir))
    finder_args, documented = doc_output()  # docs/lr_finder.md's sample: its command, and what it prints
    finder = ok("run", config.name, *finder_args)
    assert summary_of(finder.stdout) == documented, finder.stdout[-3000:]

    outputs.append((("prewarmed server's imports",), prewarmed.server_log()))
    found = [(args, line) for args, out in outputs for line in noise(out)]
    assert not found, found
