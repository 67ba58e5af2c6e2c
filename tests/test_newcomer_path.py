"""A newcomer's first hour, as commands in a shell (issue 29's acceptance): the README's quickstart run, then
`check`, `report`, `replay`, the LR finder, Ctrl-C and `--resume auto`. None of them may print a traceback or a
warning that is not about the user's own input."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.observers.test_lr_finder_doc import doc_output, summary_of
from tests.test_end_to_end import copy_examples

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# bitsandbytes' "Failed to load CPU gemm_4bit_forward" notice is issue 26's (item 10), not this path's
FOREIGN = re.compile(r"Failed to load CPU gemm_4bit_forward")
NOISE = re.compile(r"Traceback|Warning|\[warning|\bwarn\b", re.I)


def wantrain(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "wantrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# about the user's input: the LR finder's advice names the lr_finder key to change (a short sweep here)
USER_INPUT = re.compile(r"lr_finder\.\w+")


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if NOISE.search(line) and not FOREIGN.search(line) and not USER_INPUT.search(line)]


def test_the_newcomer_path_prints_no_traceback_and_no_warning(tmp_path):
    config = copy_examples(tmp_path, validation_and_samples=True)  # the quickstart as shipped
    outputs = []

    def ok(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = wantrain(*args, cwd=tmp_path)
        outputs.append((args, done.stdout + done.stderr))
        assert done.returncode == code, (args, done.stderr[-3000:])
        return done

    ok("run", config.name, "--max-steps", "6", "--run-id", "first")
    (run_dir,) = (tmp_path / "runs").glob("*__first")
    ok("check", config.name)
    ok("report", str(run_dir), "--out", str(tmp_path / "report.png"))
    ok("replay", str(run_dir))
    finder_args, documented = doc_output()  # docs/lr_finder.md's sample: its command, and what it prints
    finder = ok("run", config.name, *finder_args)
    assert summary_of(finder.stdout) == documented, finder.stdout[-3000:]

    # Ctrl-C during a run, then --resume auto
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "wantrain", "run", config.name, "--max-steps", "40",
                             "--run-id", "stopped", "--set", "validation.enabled=false",
                             "--set", "sample.enabled=false"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # the progress line prints at log steps (every 5)
        seen.append(line)
        if line.startswith("step 10/40"):
            proc.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline
    rest, _ = proc.communicate(timeout=600)
    text = "".join(seen) + rest
    outputs.append((("run", "Ctrl-C"), text))
    assert proc.returncode == 3, text[-3000:]
    resume = re.search(r"continue with: (.*)", text).group(1).split()
    assert resume[:3] == ["wantrain", "run", config.name] and resume[-2:] == ["--resume", "auto"]
    ok(*resume[1:])

    found = [(args, line) for args, out in outputs for line in noise(out)]
    assert not found, found
