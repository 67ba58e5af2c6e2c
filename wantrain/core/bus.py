"""The event bus: typed events to observers, in a documented order, with a per-observer error policy.

Guarantees (each one has a test named after it in ``tests/core/test_bus.py``):

* **One namespace per bus.** A bus keeps its own table of handlers per event class; nothing is registered
  process-wide (no signal library's global namespace), so buses (and tests) never leak receivers into each other.
  :meth:`Bus.emit` calls the handlers of the event's class from that table, in dispatch order (a signal
  library's per-send bookkeeping, blinker's ``send``, cost more than a handler: ``bench/bench_bus.py``).
* **Strong references.** The bus holds every handler strongly: a lambda, a closure or a bound method of an
  otherwise unreferenced object keeps firing until the bus is closed.
* **Deterministic order.** Handlers of an event run by priority, highest first -- ``Priority.CONTROLLER`` (observers
  that change the run through the control object), then ``Priority.SINK`` (writers, probes), then
  ``Priority.RECORDER`` -- and in subscription order within one priority. Journals (:meth:`Bus.add_journal`) see
  each event before any handler (write-ahead: a crashing handler still leaves its triggering event on record).
* **Checked subscriptions.** Subscribing to a class that is not a registered event type, or with a handler that
  cannot be called as ``handler(event, ctx)``, raises ``TypeError`` at subscription time, not inside the loop.
  An observer whose ``needs`` lists a capability the context's model adapter lacks is refused when attached
  (``core.adapter.MissingCapability``, one line naming both; the trainer checks the observers attached before
  it was built).
* **Error policy.** A *critical* observer's exception stops the dispatch and reaches the trainer as
  :class:`CriticalObserverError`; the trainer ends the run cleanly (``RunEnded(status="failed")``, every observer
  closed) and re-raises. A *passive* observer's exception is logged, an ``ObserverFailed`` event is emitted once the
  current event has reached every other handler, and after ``max_failures`` failures the observer is disabled
  (it receives nothing more) while training goes on. When a critical observer or an exception that is not an
  ``Exception`` (``KeyboardInterrupt``) aborts a dispatch, the ``ObserverFailed`` events it left pending are
  delivered before the next event.
* **Storage errors end the run, once, in one line.** An observer or journal that cannot write because the disk is
  full or the run directory read-only or not writable (``core.atomic.is_storage_error``: ``ENOSPC``, ``EDQUOT``,
  ``EROFS``, ``EACCES``, ...) is no bug of the observer's: the first such error, critical observer or passive,
  reaches the trainer as a ``core.atomic.StorageError`` naming the file and the free space (one line, exit code 2),
  and the run ends as a failed checkpoint write does, keeping its last checkpoint. Later storage errors (the same
  full disk while ``RunEnded`` is delivered) are one warning line each, without traceback, and disable their
  observer.
* **Re-entrancy.** An event emitted from inside a handler is queued and dispatched after the current event has
  reached every handler, so each handler sees events in the order they were emitted.
* **Nothing after RunEnded.** ``RunEnded`` is the last event the bus dispatches. A passive failure while
  handling it is logged but not emitted, and an event emitted during or after it (from a handler or anyone else)
  is dropped with a logged warning.
* **close() always runs.** :meth:`Bus.close` calls ``close()`` of every observer (disabled ones too), logs and
  swallows their errors, and is idempotent; the trainer calls it in a ``finally``.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import structlog

from wantrain.core.adapter import check_needs
from wantrain.core.atomic import is_storage_error, storage_error
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import Event, ObserverFailed, RunEnded, known_event_types, to_record

log = structlog.get_logger("wantrain.bus")

Handler = Callable[[Any, Any], Any]


class Priority(enum.IntEnum):
    """Dispatch order of handlers for one event: higher runs first."""

    CONTROLLER = 100
    SINK = 0
    RECORDER = -100


def on(*event_types: type[Event]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark an :class:`Observer` method as the handler of ``event_types``: ``def handle(self, event, ctx)``."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        existing = getattr(fn, "_wantrain_events", ())
        fn._wantrain_events = (*existing, *event_types)  # type: ignore[attr-defined]
        return fn

    return mark


class Observer:
    """Base class of observers: mark handler methods with :func:`on`; override :meth:`close` to flush.

    Class attributes: ``priority`` (a :class:`Priority`), ``critical`` (True: an exception stops the run),
    ``needs`` (the ``core.adapter`` capabilities it uses on ``ctx.adapter``; checked when it is attached).
    Observers reach live objects only through the ``ctx`` handed to each handler and request changes through
    ``ctx.control``; they never touch the trainer.

    State (optional): an observer that defines ``state_dict() -> dict`` and ``load_state_dict(dict)`` has its state
    saved in every checkpoint, keyed by its ``name``, and restored before ``RunStarted`` on resume (values: tensors,
    dicts, lists, str, int, float, bool, None). ``write_sidecars(directory, stem)`` may write extra files into a
    checkpoint's directory while it is being written (they are removed with it by retention).

    Emitting: an observer that emits its own registered event types defines ``bind(bus)``; :meth:`Bus.attach`
    calls it with the bus, and the observer emits there (dispatched after the current event, see Re-entrancy).

    Replay (``wantrain replay``, docs/replay.md): ``replayable = True`` declares that the observer does its work
    from events alone, with ``ctx.adapter``, ``ctx.optimizer`` and ``ctx.live`` empty; others are skipped in
    replay. ``emits`` names the registered event types it emits: replay regenerates those instead of resending
    the recorded ones.
    """

    priority: int = Priority.SINK
    critical: bool = False
    needs: tuple[type, ...] = ()
    replayable: bool = False
    emits: tuple[type[Event], ...] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def handlers(self) -> Iterator[tuple[type[Event], Handler]]:
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            for event_type in getattr(fn, "_wantrain_events", ()):
                yield event_type, getattr(self, attr)

    def close(self) -> None:
        """Release resources. Runs exactly once, at the end of the run, also after a crash."""


@attrs.define(eq=False)
class _Subscription:
    handler: Handler
    owner: Any
    name: str
    priority: int
    critical: bool
    seq: int


def _check_handler(event_type: Any, handler: Any, name: str) -> None:
    if not (isinstance(event_type, type) and issubclass(event_type, Event) and event_type in known_event_types()):
        known = ", ".join(t.__name__ for t in known_event_types())
        raise TypeError(
            f"{name}: cannot subscribe to {event_type!r}: not a registered event type (known: {known}; "
            "register your own with wantrain.core.events.register_event_type)"
        )
    if not callable(handler):
        raise TypeError(f"{name}: handler for {event_type.__name__} is not callable: {handler!r}")
    try:
        inspect.signature(handler).bind(object(), object())
    except TypeError:
        raise TypeError(
            f"{name}: handler for {event_type.__name__} must accept (event, ctx); its signature is "
            f"{inspect.signature(handler)}"
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust them


class Bus:
    """Dispatches events to handlers. See the module docstring for the guarantees."""

    def __init__(self, ctx: Any = None, *, max_failures: int = 3) -> None:
        self.ctx = ctx
        self.max_failures = max_failures
        self._subs: dict[type[Event], list[_Subscription]] = {}
        self._ordered: dict[type[Event], tuple[_Subscription, ...]] = {}  # dispatch order, rebuilt on subscribe
        self._observers: list[Any] = []  # strong references, attachment order
        self._failures: dict[int, int] = {}
        self._disabled: set[int] = set()
        self._journals: list[Callable[[dict[str, Any]], None]] = []
        self._seq = itertools.count(1)
        self._sub_seq = itertools.count()
        self._queue: deque[Event] = deque()
        self._dispatching = False
        self._pending_failures: list[ObserverFailed] = []
        self._ended = False  # RunEnded has been dispatched
        self._closed = False
        self._storage_failed = False  # a storage error has ended the run (later ones are warnings)
        self.emitted = 0

    # -- subscription ------------------------------------------------------------------------------------------
    def attach(self, observer: Any) -> Any:
        """Subscribe every ``@on`` handler of ``observer``; returns it. Its ``close()`` runs at :meth:`close`."""
        name = getattr(observer, "name", type(observer).__name__)
        priority = int(getattr(observer, "priority", Priority.SINK))
        critical = bool(getattr(observer, "critical", False))
        handlers = list(observer.handlers()) if hasattr(observer, "handlers") else []
        if not handlers:
            raise TypeError(f"{name}: observer has no handlers (mark methods with @on(EventType))")
        for event_type, handler in handlers:
            _check_handler(event_type, handler, name)
        check_needs(observer, getattr(self.ctx, "adapter", None))
        for event_type, handler in handlers:
            self._add(event_type, handler, observer, name, priority, critical)
        self._observers.append(observer)
        if callable(getattr(observer, "bind", None)):
            observer.bind(self)  # an observer that emits its own (registered) events keeps the bus it emits on
        return observer

    def subscribe(
        self,
        event_type: type[Event],
        handler: Handler,
        *,
        name: str | None = None,
        priority: int = Priority.SINK,
        critical: bool = False,
    ) -> Handler:
        """Subscribe a plain callable ``handler(event, ctx)`` (a lambda is fine: it is held strongly)."""
        name = name or getattr(handler, "__qualname__", repr(handler))
        _check_handler(event_type, handler, name)
        self._add(event_type, handler, handler, name, int(priority), critical)
        return handler

    def add_journal(self, journal: Callable[[dict[str, Any]], None], *, owner: Any = None) -> None:
        """``journal(record)`` sees the JSON record of every event before any handler (write-ahead). An
        ``owner`` with a ``close()`` method is closed with the observers."""
        self._journals.append(journal)
        if owner is not None:
            self._observers.append(owner)

    def _add(self, event_type: type[Event], handler: Handler, owner: Any, name: str, prio: int, crit: bool) -> None:
        sub = _Subscription(handler, owner, name, prio, crit, next(self._sub_seq))
        subs = self._subs.setdefault(event_type, [])
        subs.append(sub)
        subs.sort(key=lambda s: (-s.priority, s.seq))
        self._ordered[event_type] = tuple(subs)

    def _deliver(self, subs: tuple[_Subscription, ...], event: Event) -> None:
        """Call each subscription's handler in order, applying the error policy."""
        disabled, ctx = self._disabled, self.ctx
        for sub in subs:
            if disabled and id(sub.owner) in disabled:
                continue
            try:
                sub.handler(event, ctx)
            except Exception as exc:
                if is_storage_error(exc):
                    disabled.add(id(sub.owner))
                    self._storage_failure(sub.name, sub.owner, exc)
                    continue
                if sub.critical:
                    raise CriticalObserverError(sub.name, type(event).__name__, exc) from exc
                self._passive_failure(sub, id(sub.owner), event, exc)

    def _storage_failure(self, name: str, owner: Any, exc: Exception) -> None:
        """See "Storage errors" in the module docstring: the first one is raised, later ones are logged."""
        where = (getattr(exc, "path", None) or getattr(exc, "filename", None) or getattr(owner, "path", None)
                 or getattr(owner, "log_dir", None) or getattr(self.ctx, "run_dir", None) or ".")
        error = storage_error(f"the output of {name}", where, exc)
        if not self._storage_failed:
            self._storage_failed = True
            raise error from exc
        log.warning("observer_cannot_write", observer=name, error=str(error))

    def _passive_failure(self, sub: _Subscription, owner_id: int, event: Event, exc: Exception) -> None:
        count = self._failures.get(owner_id, 0) + 1
        self._failures[owner_id] = count
        disabled = count >= self.max_failures
        if disabled:
            self._disabled.add(owner_id)
        log.warning(
            "observer_failed", observer=sub.name, event_type=type(event).__name__, error=repr(exc),
            failures=count, disabled=disabled, exc_info=exc,
        )
        self._pending_failures.append(
            ObserverFailed(
                step=event.step, observer=sub.name, event_type=type(event).__name__, error=repr(exc),
                failures=count, disabled=disabled,
            )
        )

    # -- dispatch ----------------------------------------------------------------------------------------------
    def wants(self, event_type: type[Event]) -> bool:
        """Whether an event of ``event_type`` would reach anyone (a handler or a journal): the core builds its
        per-step events only then. O(1)."""
        return event_type in self._ordered or bool(self._journals)

    def emit(self, event: Event) -> None:
        """Dispatch ``event`` to its handlers (queued if called from inside a handler)."""
        if self._ended:
            log.warning("event_after_run_ended_dropped", event_type=type(event).__name__, step=event.step)
            return
        if self._dispatching:
            self._queue.append(event)  # emitted by a handler: dispatched after the current event
            return
        if self._pending_failures:
            # left by a dispatch that a critical observer or a KeyboardInterrupt aborted: report them first
            self._queue.extend(self._take_pending_failures())
        self._dispatching = True
        try:
            if self._queue or isinstance(event, RunEnded):
                self._queue.append(event)
            else:
                self._dispatch(event)  # the common case (every per-step event): straight to the handlers
                if self._pending_failures:
                    self._queue.extend(self._take_pending_failures())
            self._drain()  # events the handlers emitted, in order
        finally:
            self._dispatching = False
            self._queue.clear()

    def _drain(self) -> None:
        while self._queue:
            current = self._queue.popleft()
            self._dispatch(current)
            if isinstance(current, RunEnded):
                self._end()
                break
            if self._pending_failures:
                self._queue.extend(self._take_pending_failures())

    def _take_pending_failures(self) -> list[ObserverFailed]:
        failures, self._pending_failures = self._pending_failures, []
        return failures

    def _end(self) -> None:
        """RunEnded has reached every handler: nothing more is dispatched (failures on it were logged already)."""
        self._ended = True
        self._pending_failures.clear()
        for late in self._queue:
            log.warning("event_after_run_ended_dropped", event_type=type(late).__name__, step=late.step)
        self._queue.clear()

    def _dispatch(self, event: Event) -> None:
        self.emitted += 1
        if self._journals:
            record = to_record(event, next(self._seq), time.time())
            for journal in list(self._journals):
                try:
                    journal(record)
                except Exception as exc:
                    if not is_storage_error(exc):
                        raise
                    owner = getattr(journal, "__self__", None)
                    self._journals.remove(journal)  # a journal that cannot write records nothing more
                    self._storage_failure(getattr(owner, "name", repr(journal)), owner, exc)
        subs = self._ordered.get(type(event))
        if subs is not None:
            self._deliver(subs, event)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def observers(self) -> tuple[Any, ...]:
        return tuple(self._observers)

    def close(self) -> None:
        """Run every observer's ``close()`` once (errors are logged, not raised), then drop all receivers."""
        if self._closed:
            return
        self._closed = True
        for observer in self._observers:
            close = getattr(observer, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:
                name = getattr(observer, "name", repr(observer))
                if is_storage_error(exc):  # the full disk the run already ended on: one line, no traceback
                    log.warning("observer_close_failed", observer=name, error=str(storage_error(
                        f"the output of {name}", getattr(observer, "path", None) or ".", exc)))
                    continue
                log.warning("observer_close_failed", observer=name, error=repr(exc), exc_info=exc)
        self._subs.clear()
        self._ordered.clear()
        self._journals.clear()
        self.ctx = None
