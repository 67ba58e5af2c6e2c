"""``wantrain`` commands run in the test process: what a subprocess of ``python -m wantrain`` would give
(its exit code, stdout and stderr) without a fresh interpreter importing torch, diffusers and transformers again
(~15 s of CPU each on the 2-core CI machine). For the runs a test only compares with others (the uninterrupted
run, the resume after a kill); the kills, signals and first-run-of-a-process checks stay real subprocesses."""

from __future__ import annotations

import contextlib
import io
import subprocess

from wantrain.cli.main import main


def wantrain(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["wantrain", *args], code, out.getvalue(), err.getvalue())
