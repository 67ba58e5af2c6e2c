"""No rank waits forever: a failure on one rank ends every rank within seconds (docs/distributed.md, "When a rank
fails").

A rank that fails where the others cannot learn it through the next collective (an out-of-memory error in a
forward that exchanges shards or tokens with the other ranks, any exception that leaves the loop) writes one
record to the process group's key-value store (the c10d store torchrun's rendezvous set up: a side channel that
needs no collective) and raises :class:`RankFailed`. Every rank runs a :class:`FailureWatch`, a daemon thread that
polls the store; when another rank's record appears it prints one line -- which rank failed, why, and the
checkpoint to resume from -- and ends its process (``os._exit``: its main thread may sit in a collective that no
longer has a partner, where no Python exception reaches it).

Where a step can be skipped together (data parallel, expert groups without sharding: the forward exchanges
nothing), an out-of-memory error still goes through ``agree_step`` and every rank skips the step; this module is
only the path of what cannot be skipped. A peer that dies (killed, lost) closes its connections: the other ranks'
next collective raises, and they announce it here like any exception.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wantrain.core.errors import UserError

FAILED_KEY = "wantrain/rank_failed"
"""The store key of the first failure (JSON: ``rank``, ``cause``); later failures do not overwrite it."""

HINT_KEY = "wantrain/resume_hint"
"""The store key of the checkpoint to resume from, as rank 0 sees it once a failure is announced: rank 0 writes
the checkpoints, so another rank that failed right after a save (before rank 0 renamed it into place) names the
same one as rank 0."""

WRITE_WAIT_S = 30.0
"""How long rank 0's watch waits for a save in progress on its own rank (:attr:`FailureWatch.writing`) before it
names the checkpoint to resume from: another rank can fail at the step after a save while rank 0 still writes it,
and that checkpoint is the one to resume from. A save whose gather never completes (its peer failed first) is
waited for this long, then the newest complete one is named."""

SAVING_KEY = "wantrain/rank0_saving"
"""Set by rank 0 when it learns of a failure halfway through a save: the others then wait for its
:data:`HINT_KEY` up to :data:`WRITE_WAIT_S` longer."""

HINT_WAIT_S = 5.0
"""How long a rank other than 0 waits for rank 0's :data:`HINT_KEY` (or :data:`SAVING_KEY`) before naming the
checkpoint as it sees it (rank 0 is gone or slow)."""

WATCH_INTERVAL_S = 0.2
"""How often a :class:`FailureWatch` polls the store: one small request, negligible beside a training step."""

GRACE_S = 1.0
"""How long a watch lets its own process end by itself once another rank failed (a refusal every rank raises,
an error every rank meets): its own line then stands; past it, the watch ends the process."""

EXIT_CODE = 1
"""The exit code of a rank ended because another rank failed (README: 1 failed)."""


class RankFailed(UserError):
    """This rank failed where the others cannot skip with it; already announced to them. ``str()`` is the one line
    (the rank, the cause, the checkpoint to resume from). Exit code 1: the input was fine, the run failed."""

    exit_code = EXIT_CODE


def resume_hint(checkpoints: Path | None) -> str:
    """Where a failed run continues: its newest complete checkpoint in ``checkpoints`` (``--resume auto`` picks
    it), or that there is none yet."""
    from wantrain.core.checkpoint import latest_complete

    if checkpoints is None:
        return "this run writes no checkpoint: run again"
    try:
        best = latest_complete(checkpoints)[0]
    except OSError:
        best = None
    if best is None:
        return f"no complete checkpoint in '{checkpoints}' yet: run again"
    return f"resume from '{best.path}' (step {best.step}) with --resume auto"


def failure_line(rank: int, cause: str, checkpoints: Path | None) -> str:
    """The one line every rank prints: ``rank R failed: CAUSE; every rank stopped; resume from ...``."""
    cause = " ".join(str(cause).split())
    return f"rank {rank} failed: {cause}; every rank stopped; {resume_hint(checkpoints)}"


class FailureWatch:
    """One rank's end of the side channel (module docstring). ``store``: the process group's c10d store;
    ``exit``: how the process ends (``os._exit``; a test passes its own)."""

    def __init__(self, store: Any, rank: int, *, exit: Callable[[int], Any] = os._exit,
                 interval_s: float = WATCH_INTERVAL_S, grace_s: float = GRACE_S) -> None:
        self.store, self.rank, self._exit = store, rank, exit
        self.interval_s, self.grace_s = interval_s, grace_s
        self.checkpoints: Path | None = None  # set once the run directory is known (the resume hint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.announced = False
        self.writing = threading.RLock()
        """Held by the loop while this rank saves (``core.loop``'s write path): rank 0's hint waits for it, and the
        watch never ends the process halfway through a checkpoint."""

    # -- the failing rank ----------------------------------------------------------------------------------------
    def announce(self, cause: str) -> RankFailed:
        """Tell every rank that this one failed with ``cause`` (the first failure of the run is the one kept) and
        return the error this rank raises, naming rank 0's checkpoint to resume from. Never raises itself: a store
        already gone (the run is ending) is ignored."""
        cause = " ".join(str(cause).split())
        if not self.announced:
            self.announced = True
            try:
                if self.rank == 0:
                    self.store.set(HINT_KEY, resume_hint(self.checkpoints))
                self.store.compare_set(FAILED_KEY, "", json.dumps({"rank": self.rank, "cause": cause}))
            except Exception:  # noqa: BLE001 -- the store is torchrun's; a closed one leaves torchrun to end us
                pass
        found = self._failure_or_none()
        rank, cause = found if found is not None else (self.rank, cause)
        return RankFailed(f"rank {rank} failed: {cause}; every rank stopped; {self.hint()}")

    def hint(self) -> str:
        """The checkpoint to resume from: rank 0's (:data:`HINT_KEY`; rank 0 publishes it when it learns of a
        failure, once its own save in progress is written), waited for up to :data:`HINT_WAIT_S` (longer while
        rank 0 says it is saving), else this rank's own view."""
        if self.rank == 0:
            hint = resume_hint(self.checkpoints) if self._saves_settled() else self._hint_while_saving()
            with contextlib.suppress(Exception):  # as in announce
                self.store.set(HINT_KEY, hint)
            return hint
        for wait_s in (HINT_WAIT_S, WRITE_WAIT_S):
            try:
                self.store.wait([HINT_KEY], datetime.timedelta(seconds=wait_s))
                return self.store.get(HINT_KEY).decode("utf-8")
            except Exception:  # noqa: BLE001 -- rank 0 is gone, slow, or still saving
                if not self._rank0_saving():
                    break
        return resume_hint(self.checkpoints)

    def _rank0_saving(self) -> bool:
        try:
            return bool(self.store.check([SAVING_KEY]))
        except Exception:  # noqa: BLE001 -- the store went away
            return False

    def _saves_settled(self) -> bool:
        """Wait up to :data:`WRITE_WAIT_S` for this rank's save in progress, if any (telling the other ranks through
        :data:`SAVING_KEY`); whether none is left."""
        if not self.writing.acquire(blocking=False):
            with contextlib.suppress(Exception):  # as in announce
                self.store.set(SAVING_KEY, "1")
            if not self.writing.acquire(timeout=WRITE_WAIT_S):
                return False
        self.writing.release()
        return True

    def _hint_while_saving(self) -> str:
        return f"{resume_hint(self.checkpoints)} (a checkpoint was still being written when the run ended)"

    def other_failure(self) -> RankFailed | None:
        """Another rank's announced failure as this rank's error (its collective failed because that rank left),
        or None when none is recorded or the recorded one is this rank's."""
        found = self._failure_or_none()
        if found is None or found[0] == self.rank:
            return None
        return RankFailed(f"rank {found[0]} failed: {found[1]}; every rank stopped; {self.hint()}")

    # -- every rank ----------------------------------------------------------------------------------------------
    def failure(self) -> tuple[int, str] | None:
        """An announced failure (rank, cause), or None. One store request."""
        if not self.store.check([FAILED_KEY]):
            return None
        record = json.loads(self.store.get(FAILED_KEY).decode("utf-8"))
        return int(record["rank"]), str(record["cause"])

    def _failure_or_none(self) -> tuple[int, str] | None:
        try:
            return self.failure()
        except Exception:  # noqa: BLE001 -- the store went away
            return None

    def start(self) -> FailureWatch:
        """Poll the store on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="wantrain-failure-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the polling (the run ended; before the process group is destroyed)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                found = self.failure()
            except Exception:  # noqa: BLE001 -- the store went away: the run is ending, the collectives say why
                return
            if found is None or found[0] == self.rank or self.announced:
                continue
            if self.rank == 0:
                self.hint()  # published at once: the failing rank waits for it
            if self._stop.wait(self.grace_s):  # the process ended its run by itself meanwhile
                return
            rank, cause = found
            print(f"wantrain run: error: rank {rank} failed: {cause}; every rank stopped; {self.hint()}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            self._exit(EXIT_CODE)
            return


def default_store() -> Any:
    """The default process group's store (torchrun's rendezvous store under a prefix), or None."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def watch_default_group(rank: int) -> FailureWatch | None:
    """A started :class:`FailureWatch` on the default group's store, or None when it has none."""
    store = default_store()
    return FailureWatch(store, rank).start() if store is not None else None


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: the cause an exception announces."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


__all__ = ["FAILED_KEY", "FailureWatch", "RankFailed", "failure_line", "first_line", "resume_hint",
           "watch_default_group"]

