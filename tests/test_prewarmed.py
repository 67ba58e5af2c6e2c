"""``tests/prewarmed.py``: a command forked from the prewarmed server gives what ``python`` gives for it (exit code,
stdout, stderr, a signal's effect, its working directory, environment and ``sys.argv``), the runs that rely on it
(kills, signals, locks) see a real process, and the server is no child of the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import prewarmed
import psutil
import pytest

SNIPPETS = [
    "print('out'); import sys; print('err', file=sys.stderr)",
    "import sys; sys.exit(3)",
    "import sys; sys.exit('a message')",
    "import sys; print(sys.argv[1:]); sys.exit(None)",
    "import os; print(os.getcwd(), os.environ.get('PREWARMED_PROBE'))",
    "import atexit; atexit.register(print, 'at exit'); print('body')",
    "import threading, time; threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()",
    "raise KeyboardInterrupt",
    "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "raise ValueError('the last line')",
]


@pytest.mark.parametrize("code", SNIPPETS)
def test_a_forked_command_gives_what_python_gives(code, tmp_path):
    env = {**os.environ, "PREWARMED_PROBE": "seen"}
    argv = ["-c", code, "one", "two"]
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=60)
    forked = prewarmed.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    # a traceback names other frames above the command's own; its last line is the same
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_a_signal_reaches_the_forked_process_and_its_pid_is_real(tmp_path):
    proc = prewarmed.Popen(["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True)
    assert int(proc.stdout.readline()) == proc.pid and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.stdout.close()


def test_the_server_is_no_child_of_the_test_process():
    assert prewarmed.run(["-c", "pass"]).returncode == 0
    children = psutil.Process().children(recursive=True)
    assert not [p for p in children if "prewarmed" in " ".join(p.cmdline())]


def test_the_relay_passes_a_signal_on_and_ends_with_its_forks_code(tmp_path):
    """What torchrun sees of a rank started through ``tests/prewarmed_relay.py``: the fork's output and exit code,
    and a SIGTERM sent to the relay ends the fork (torchrun's way of stopping the other ranks)."""
    relay = [sys.executable, str(Path(__file__).with_name("prewarmed_relay.py"))]
    env = {**os.environ, "PREWARMED_SERVER": prewarmed.server()}
    done = subprocess.run([*relay, "-c", "import os; print(os.environ['RANK']); raise SystemExit(3)"],
                          capture_output=True, text=True, env={**env, "RANK": "1"}, timeout=60)
    assert (done.returncode, done.stdout) == (3, "1\n")
    proc = subprocess.Popen([*relay, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, env=env)
    fork = psutil.Process(int(proc.stdout.readline()))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not fork.is_running() or fork.status() == psutil.STATUS_ZOMBIE
    proc.stdout.close()
