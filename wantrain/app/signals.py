"""SIGINT/SIGTERM during a run: a clean stop with a checkpoint; a second Ctrl-C aborts."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any


class RunInterrupted(BaseException):
    """A signal arrived before the first step (while the cache was filling): the run ends ``stopped``.
    A BaseException so that no ``except Exception`` in the data code swallows it."""


@contextlib.contextmanager
def stop_on_signals(control_ref: list[Any]) -> Iterator[None]:
    """SIGINT/SIGTERM: before training (``control_ref`` empty) raise :class:`RunInterrupted`; during training ask
    the trainer's control for a clean stop (checkpoint and LoRA are saved); a second Ctrl-C aborts at once."""
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not control_ref:
            raise RunInterrupted(f"signal {name}")
        control = control_ref[0]
        if control.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        control.request_stop(f"signal {name}")
        print(f"\nwantrain: {name} received; stopping after this step and writing a checkpoint "
              "(Ctrl-C again to abort without saving)", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread (tests): no handler
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
