"""SIGINT/SIGTERM during a run: a clean stop with a checkpoint; a second Ctrl-C aborts.

* Before the run directory exists (``prepare()``): Python's own handler; Ctrl-C aborts (exit code 130) and nothing
  was written. Except while ``prepare()`` fills the cache before the experts load (one process): there
  :class:`RunInterrupted`, and the run ends ``stopped`` (exit code 3) with no run directory made (the cache keeps
  every whole entry).
* From the run directory's creation to the first step (the cache filling under torchrun): :class:`RunInterrupted`,
  the run ends ``stopped`` (exit code 3) with its log closed. A signal while the run directory is set up lands once
  its files are written (``core.atomic.critical_section``).
* During training: the first signal asks the trainer for a clean stop (LoRA files and a checkpoint of the current
  step, exit code 3); a second Ctrl-C aborts at once (:class:`RunAborted`, exit code 130), except between the two
  renames of a checkpoint that replaces one of the same step, where it lands right after them
  (``core.atomic.raise_when_safe``). The abort's message says what is on disk (:func:`describe_abort`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wantrain.core.atomic import raise_when_safe
from wantrain.core.checkpoint import latest_complete


class RunInterrupted(BaseException):
    """A signal arrived before the first step (while the cache was filling): the run ends ``stopped``.
    A BaseException so that no ``except Exception`` in the data code swallows it."""


class RunAborted(KeyboardInterrupt):
    """A second Ctrl-C ended a run; ``str()`` says what was saved (:func:`describe_abort`)."""


@contextlib.contextmanager
def stop_on_signals(control_ref: list[Any]) -> Iterator[None]:
    """SIGINT/SIGTERM: before training (``control_ref`` empty) raise :class:`RunInterrupted`; during training ask
    the trainer's control for a clean stop (checkpoint and LoRA are saved); a second Ctrl-C aborts at once."""
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not control_ref:
            raise_when_safe(RunInterrupted(f"signal {name}"))
            return
        control = control_ref[0]
        if control.stop_requested:
            if signum == signal.SIGINT:
                raise_when_safe(KeyboardInterrupt())
            return  # a second SIGTERM (a preemption repeating itself): the stop under way saves once
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


def describe_abort(trainer: Any, run_dir: Path) -> str:
    """What a run aborted by a second Ctrl-C left, read from the disk: the step it reached, the LoRA files this
    process wrote (the last ones), and the newest complete checkpoint, which ``--resume auto`` continues from."""
    step = trainer.state.step
    saved = list(trainer.saved)
    policy = trainer.checkpoints
    best = latest_complete(policy.directory)[0] if policy is not None else None
    parts = [f"aborted by a second Ctrl-C at step {step}"]
    if saved:
        parts.append(f"LoRA files written by this run: {len(saved)}, the last '{saved[-1]}'")
    if best is not None:
        parts.append(f"the newest complete checkpoint is '{best.path}' (step {best.step}): --resume auto "
                     f"continues from there; what was trained after step {best.step} is not in it")
    elif policy is not None:
        parts.append(f"no complete checkpoint in '{policy.directory}': there is nothing to resume; run again")
    return "; ".join(parts)
