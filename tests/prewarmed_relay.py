"""A torchrun worker that is a fork of the test process's prewarmed server (``tests/prewarmed.py``):
``torchrun OPTIONS tests/prewarmed_relay.py -m wantrain run ...`` with ``PREWARMED_SERVER`` (:func:`prewarmed.server`)
in torchrun's environment. Each rank then costs a fork, not ~16 s of CPU importing and tearing down the stack.

The relay is the process torchrun starts and watches: it hands its stdout, stderr, environment (the rank's
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) and working directory to the fork, passes on the
signals torchrun sends (SIGINT, SIGTERM, SIGHUP, SIGQUIT), and ends as the fork ended: its exit code, or the same
signal. Only for the torchrun tests that are not about ``torchrun -m wantrain`` itself
(tests/test_distributed_launch.py's quickstart and two-node tests launch that)."""

from __future__ import annotations

import os
import signal
import sys

import prewarmed


def main() -> None:
    proc = prewarmed.Popen(sys.argv[1:])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        # os.kill, not proc.send_signal: that polls the connection that proc.wait() below is blocked on
        signal.signal(signum, lambda received, _frame: os.kill(proc.pid, received))
    code = proc.wait()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
