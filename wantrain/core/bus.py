"""The event bus: typed events on blinker signals, in a documented order, with a per-observer error policy.

Each event type has a signal named as the design names it -- ``step_start``, ``loss_computed``, ``grads_ready``,
``checkpoint_saved`` -- or, for the others, the event class's name in snake case (``run_started``,
``optimizer_stepped``, ``metrics_logged``, ``run_ended``, an observer's ``AlphaChanged``: ``alpha_changed``;
:func:`signal_name`). :meth:`Bus.emit` sends the event through its signal (blinker's ``Signal.send``, the event as
the sender, ``ctx=`` the bus's context). Two ways to subscribe, one bus:

* an :class:`Observer` (methods marked with :func:`on`) given to :meth:`Bus.attach`, as the run's observers are;
* a plain function ``fn(event, ctx)`` connected with blinker's own API: ``bus.signal("loss_computed").connect(fn)``,
  or as a decorator, ``@bus.signal("loss_computed").connect`` (:meth:`Bus.subscribe` does the same with an event
  class).

Guarantees (each one has a test named after it in ``tests/core/test_bus.py``):

* **One namespace per bus.** A bus keeps its signals in its own ``blinker.Namespace`` (:attr:`Bus.namespace`);
  nothing is registered in blinker's global namespace, so buses (and tests) never leak receivers into each other.
* **Strong references.** Receivers are connected with ``weak=False`` (blinker's default, ``weak=True``, is
  refused): a lambda, a closure or a bound method of an otherwise unreferenced object keeps firing until the bus
  is closed.
* **Deterministic order.** Receivers of an event run by priority, highest first -- ``Priority.CONTROLLER``
  (observers that change the run through the control object), then ``Priority.SINK`` (writers, probes, and plain
  functions unless ``priority=`` says otherwise), then ``Priority.RECORDER`` -- and in connection order within one
  priority. blinker calls receivers in connection order when its ``set_class`` is ordered (the signals use an
  insertion-ordered set); connecting a receiver of higher priority reconnects the lower ones after it. Journals
  (:meth:`Bus.add_journal`) see each event before any receiver (write-ahead: a crashing handler still leaves its
  triggering event on record).
* **Checked subscriptions.** Subscribing to a class that is not a registered event type, to a signal name no
  registered event type has, or with a handler that cannot be called as ``handler(event, ctx)``, raises
  ``TypeError`` at subscription time, not inside the loop. An observer whose ``needs`` lists a capability the
  context's model adapter lacks is refused when attached (``core.adapter.MissingCapability``, one line naming
  both; the trainer checks the observers attached before it was built).
* **Error policy.** Every receiver is wrapped before blinker sees it (blinker itself lets the first exception end
  the send). A *critical* receiver's exception stops the dispatch and reaches the trainer as
  :class:`CriticalObserverError`; the trainer ends the run cleanly (``RunEnded(status="failed")``, every observer
  closed) and re-raises. A *passive* receiver's exception is logged, an ``ObserverFailed`` event is emitted once
  the current event has reached every other receiver, and after ``max_failures`` failures the observer (or plain
  function) is disconnected from every signal (it receives nothing more) while training goes on. When a critical
  receiver or an exception that is not an ``Exception`` (``KeyboardInterrupt``) aborts a dispatch, the
  ``ObserverFailed`` events it left pending, and the events its receivers had emitted (queued), are delivered
  before the next event (with a warning when the dispatch is aborted; a warning each at :meth:`Bus.close` if no
  event came after): nothing emitted is dropped unrecorded but what comes after ``RunEnded``.
* **Storage errors end the run, once, in one line.** An observer or journal that cannot write because the disk is
  full or the run directory read-only or not writable (``core.atomic.is_storage_error``: ``ENOSPC``, ``EDQUOT``,
  ``EROFS``, ``EACCES``, ...) is no bug of the observer's: the first such error, critical observer or passive,
  reaches the trainer as a ``core.atomic.StorageError`` naming the file and the free space (one line, exit code 2),
  and the run ends as a failed checkpoint write does, keeping its last checkpoint. Later storage errors (the same
  full disk while ``RunEnded`` is delivered) are one warning line each, without traceback, and disable their
  observer.
* **Re-entrancy.** An event emitted from inside a handler is queued and dispatched after the current event has
  reached every receiver, so each receiver sees events in the order they were emitted.
* **Nothing after RunEnded.** ``RunEnded`` is the last event the bus dispatches. A passive failure while
  handling it is logged but not emitted, and an event emitted during or after it (from a handler or anyone else)
  is dropped with a logged warning.
* **close() always runs.** :meth:`Bus.close` calls ``close()`` of every observer (disabled ones too), logs and
  swallows their errors, disconnects every receiver, and is idempotent; the trainer calls it in a ``finally``.

Emit through :meth:`Bus.emit`, not ``signal.send``: the journals, the queue and the RunEnded rule live in the bus.
What blinker's ``send`` costs per event is in docs/benchmarks.md (``bench/bench_bus.py``).
"""

from __future__ import annotations

import enum
import inspect
import itertools
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import blinker
import structlog

from wantrain.core.adapter import check_needs
from wantrain.core.atomic import is_storage_error, storage_error
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import Event, ObserverFailed, RunEnded, known_event_types, to_record

log = structlog.get_logger("wantrain.bus")

Handler = Callable[[Any, Any], Any]

# The design's names for the four events it names; the others are their class name in snake case.
DESIGN_NAMES = {"StepStarted": "step_start", "LossComputed": "loss_computed", "GradsReady": "grads_ready",
                "CheckpointSaved": "checkpoint_saved"}
_WORD_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def signal_name(event_type: type[Event]) -> str:
    """The name of ``event_type``'s signal: ``StepStarted`` -> ``step_start`` (the design's four names),
    ``OptimizerStepped`` -> ``optimizer_stepped``, ``LRChanged`` -> ``lr_changed``."""
    name = event_type.__name__
    return DESIGN_NAMES.get(name) or _WORD_BOUNDARY.sub("_", name).lower()


class Priority(enum.IntEnum):
    """Dispatch order of receivers for one event: higher runs first."""

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


def _receiver_key(receiver: Any) -> Any:
    """Who a receiver is, as blinker tells receivers apart: a bound method by its function and instance (each
    attribute access makes a new method object), anything else by identity."""
    if inspect.ismethod(receiver):
        return id(receiver.__func__), id(receiver.__self__)
    return id(receiver)


def _check_event_type(event_type: Any, name: str) -> type[Event]:
    if not (isinstance(event_type, type) and issubclass(event_type, Event) and event_type in known_event_types()):
        known = ", ".join(t.__name__ for t in known_event_types())
        raise TypeError(
            f"{name}: cannot subscribe to {event_type!r}: not a registered event type (known: {known}; "
            "register your own with wantrain.core.events.register_event_type)"
        )
    return event_type


def _check_signature(event_type: type[Event], handler: Any, name: str) -> None:
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


# -- the error policy: failures counted per observer (or plain function), shared by the bus and its signals --------
@attrs.define(eq=False)
class _Owner:
    """What a failure is counted against: an observer, or a plain function (held strongly, so its id is stable)."""

    obj: Any
    name: str
    failures: int = 0
    connections: list[tuple[EventSignal, Any]] = attrs.Factory(list)  # (signal, _receiver_key of the handler)


class _Policy:
    """Failure counts and the ``ObserverFailed`` events not yet emitted. The bus and its signals share it (the
    signals never reference the bus, so a dropped bus is freed without waiting for the cycle collector)."""

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.pending: list[ObserverFailed] = []
        self.storage_failed = False  # a storage error has ended the run (later ones are warnings)
        self._owners: dict[Any, _Owner] = {}  # by _receiver_key of the observer or function

    def owner(self, obj: Any, name: str) -> _Owner:
        key = _receiver_key(obj)
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = _Owner(obj, name)
        return owner

    def disconnect(self, owner: _Owner) -> None:
        for signal, receiver_id in owner.connections:
            signal._disconnect_id(receiver_id)
        owner.connections.clear()

    def storage_failure(self, name: str, obj: Any, exc: Exception, ctx: Any) -> None:
        """See "Storage errors" in the module docstring: the first one is raised, later ones are logged."""
        where = (getattr(exc, "path", None) or getattr(exc, "filename", None) or getattr(obj, "path", None)
                 or getattr(obj, "log_dir", None) or getattr(ctx, "run_dir", None) or ".")
        error = storage_error(f"the output of {name}", where, exc)
        if not self.storage_failed:
            self.storage_failed = True
            raise error from exc
        log.warning("observer_cannot_write", observer=name, error=str(error))

    def passive_failure(self, owner: _Owner, event: Event, exc: Exception) -> None:
        owner.failures += 1
        disabled = owner.failures >= self.max_failures
        if disabled:
            self.disconnect(owner)
        log.warning(
            "observer_failed", observer=owner.name, event_type=type(event).__name__, error=repr(exc),
            failures=owner.failures, disabled=disabled, exc_info=exc,
        )
        self.pending.append(
            ObserverFailed(
                step=event.step, observer=owner.name, event_type=type(event).__name__, error=repr(exc),
                failures=owner.failures, disabled=disabled,
            )
        )


def _policy_receiver(handler: Handler, owner: _Owner, critical: bool, policy: _Policy) -> Callable[..., None]:
    """What blinker calls for ``handler``: ``receive(event, ctx=ctx)`` -> ``handler(event, ctx)``, the exception
    turned into a :class:`CriticalObserverError` (critical) or counted, logged and reported (passive)."""

    def receive(event: Event, ctx: Any = None) -> None:
        try:
            handler(event, ctx)
        except Exception as exc:
            if is_storage_error(exc):  # a full or read-only disk is no bug of the observer's
                policy.disconnect(owner)
                policy.storage_failure(owner.name, owner.obj, exc, ctx)
                return
            if critical:
                raise CriticalObserverError(owner.name, type(event).__name__, exc) from exc
            policy.passive_failure(owner, event, exc)

    receive.__qualname__ = f"receive[{owner.name}]"
    return receive


class _OrderedSet(dict):
    """blinker's ``set_class``: a set that iterates in insertion order (a dict's keys). blinker uses ``add``,
    ``discard``, iteration, ``copy()`` and ``|``; the last two return dicts, which iterate the same way."""

    def add(self, key: Any) -> None:
        self[key] = None

    def discard(self, key: Any) -> None:
        self.pop(key, None)


@attrs.define(eq=False)
class _Connection:
    receiver: Callable[..., None]  # what blinker holds and calls
    priority: int


class EventSignal(blinker.NamedSignal):
    """The signal of one event type on one bus: blinker's ``NamedSignal``, with the bus's guarantees on
    ``connect``: ``connect(fn)`` checks that ``fn`` takes ``(event, ctx)``, holds it strongly (``weak=True`` is
    refused), wraps it in the error policy and keeps receivers in priority order. Keyword-only extras:
    ``priority`` (default ``Priority.SINK``), ``critical`` (default False) and ``name`` (how failures name it;
    default the function's qualified name). Connecting the same function twice connects it once, and
    ``disconnect(fn)``, ``connected_to(fn)`` and ``@signal.connect`` work as in blinker. A receiver is called as
    ``fn(event, ctx)``. ``sender=`` is refused: the sender of every send is the event itself.
    """

    set_class = _OrderedSet

    def __init__(self, name: str, event_type: type[Event], policy: _Policy) -> None:
        super().__init__(name, doc=f"{event_type.__name__} events; receivers take (event, ctx)")
        self.event_type = event_type
        self._policy = policy
        self._connections: dict[Any, _Connection] = {}  # _receiver_key of a connected function -> its wrapper
        self._order: list[_Connection] = []  # dispatch order

    def connect(self, receiver: Any, sender: Any = blinker.ANY, weak: bool = False, *,
                name: str | None = None, priority: int = Priority.SINK, critical: bool = False) -> Any:
        return self._connect(receiver, sender, weak, name=name, priority=priority, critical=critical)

    def _connect(self, receiver: Any, sender: Any = blinker.ANY, weak: bool = False, *, name: str | None = None,
                 priority: int = Priority.SINK, critical: bool = False, owner: _Owner | None = None) -> Any:
        name = name or getattr(receiver, "__qualname__", repr(receiver))
        if sender is not blinker.ANY:
            raise TypeError(f"{name}: signal {self.name!r} is sent with the event as the sender; connect without "
                            "sender= and look at the event in the receiver")
        if weak:
            raise TypeError(f"{name}: the bus holds its receivers strongly (weak=False); disconnect a receiver "
                            "or close the bus to drop it")
        _check_signature(self.event_type, receiver, name)
        key = _receiver_key(receiver)
        if key in self._connections:
            return receiver
        owner = owner or self._policy.owner(receiver, name)
        wrapped = _policy_receiver(receiver, owner, critical, self._policy)
        connection = _Connection(wrapped, int(priority))
        later = [c for c in self._order if c.priority < connection.priority]
        for c in later:  # blinker calls in connection order: what must run after the new receiver reconnects
            super().disconnect(c.receiver)
        super().connect(wrapped, blinker.ANY, False)
        for c in later:
            super().connect(c.receiver, blinker.ANY, False)
        self._order.insert(len(self._order) - len(later), connection)
        self._connections[key] = connection
        owner.connections.append((self, key))
        return receiver

    def disconnect(self, receiver: Any, sender: Any = blinker.ANY) -> None:
        self._disconnect_id(_receiver_key(receiver))

    def _disconnect_id(self, key: Any) -> None:
        connection = self._connections.pop(key, None)
        if connection is not None:
            self._order.remove(connection)
            super().disconnect(connection.receiver)

    def _disconnect_all(self) -> None:
        for key in list(self._connections):
            self._disconnect_id(key)


class _BusNamespace(blinker.Namespace):
    """One bus's signals by name; ``signal(name)`` creates an :class:`EventSignal` for a registered event type."""

    def __init__(self, policy: _Policy) -> None:
        super().__init__()
        self._policy = policy
        self.by_type: dict[type[Event], EventSignal] = {}  # what Bus.emit looks up

    def signal(self, name: str, doc: str | None = None, *, event_type: type[Event] | None = None) -> EventSignal:
        signal = self.get(name)
        if signal is None:
            if event_type is None:
                event_type = _event_type_named(name)
            signal = EventSignal(name, event_type, self._policy)
            self[name] = signal
            self.by_type[event_type] = signal
        elif event_type is not None and signal.event_type is not event_type:
            raise TypeError(f"{event_type.__name__} and {signal.event_type.__name__} both have the signal name "
                            f"{name!r} on this bus; rename one of the event classes")
        return signal  # type: ignore[return-value]


def _event_type_named(name: str) -> type[Event]:
    for event_type in reversed(known_event_types()):  # a type registered again under its name replaces the old
        if signal_name(event_type) == name:
            return event_type
    known = ", ".join(signal_name(t) for t in known_event_types())
    raise TypeError(f"no registered event type has the signal {name!r} (known: {known})")


class Bus:
    """Dispatches events through one blinker signal per event type. See the module docstring for the guarantees."""

    def __init__(self, ctx: Any = None, *, max_failures: int = 3) -> None:
        self.ctx = ctx
        self._policy = _Policy(max_failures)
        self.namespace: blinker.Namespace = _BusNamespace(self._policy)
        self._signals = self.namespace.by_type
        self._observers: list[Any] = []  # strong references, attachment order
        self._journals: list[Callable[[dict[str, Any]], None]] = []
        self._seq = itertools.count(1)
        self._queue: deque[Event] = deque()
        self._left: list[Event] = []  # emitted during a dispatch that was aborted: delivered before the next event
        self._dispatching = False
        self._ended = False  # RunEnded has been dispatched
        self._closed = False
        self.emitted = 0

    @property
    def max_failures(self) -> int:
        return self._policy.max_failures

    @max_failures.setter
    def max_failures(self, value: int) -> None:
        self._policy.max_failures = value

    # -- subscription ------------------------------------------------------------------------------------------
    def signal(self, event: str | type[Event]) -> EventSignal:
        """The signal of an event type, by name (``"loss_computed"``) or by class (``LossComputed``); connect plain
        functions ``fn(event, ctx)`` to it with blinker's API (``.connect(fn)``, ``@....connect``)."""
        if isinstance(event, str):
            return self.namespace.signal(event)
        event_type = _check_event_type(event, repr(event))
        return self.namespace.signal(signal_name(event_type), event_type=event_type)  # type: ignore[call-arg]

    def attach(self, observer: Any) -> Any:
        """Connect every ``@on`` handler of ``observer``; returns it. Its ``close()`` runs at :meth:`close`, once:
        attaching an observer that is attached already changes nothing."""
        if any(attached is observer for attached in self._observers):
            return observer
        name = getattr(observer, "name", type(observer).__name__)
        priority = int(getattr(observer, "priority", Priority.SINK))
        critical = bool(getattr(observer, "critical", False))
        handlers = list(observer.handlers()) if hasattr(observer, "handlers") else []
        if not handlers:
            raise TypeError(f"{name}: observer has no handlers (mark methods with @on(EventType))")
        for event_type, handler in handlers:  # all checked before any is connected
            _check_signature(_check_event_type(event_type, name), handler, name)
        check_needs(observer, getattr(self.ctx, "adapter", None))
        owner = self._policy.owner(observer, name)
        for event_type, handler in handlers:
            self.signal(event_type)._connect(handler, name=name, priority=priority, critical=critical, owner=owner)
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
        """Connect a plain callable ``handler(event, ctx)`` to ``event_type``'s signal (a lambda is fine: it is
        held strongly); the same as ``bus.signal(event_type).connect(handler, ...)``."""
        name = name or getattr(handler, "__qualname__", repr(handler))
        _check_event_type(event_type, name)
        return self.signal(event_type).connect(handler, name=name, priority=priority, critical=critical)

    def add_journal(self, journal: Callable[[dict[str, Any]], None], *, owner: Any = None) -> None:
        """``journal(record)`` sees the JSON record of every event before any receiver (write-ahead). An
        ``owner`` with a ``close()`` method is closed with the observers."""
        self._journals.append(journal)
        if owner is not None:
            self._observers.append(owner)

    # -- dispatch ----------------------------------------------------------------------------------------------
    def wants(self, event_type: type[Event]) -> bool:
        """Whether an event of ``event_type`` would reach anyone (a receiver or a journal): the core builds its
        per-step events only then (blinker's advice: check ``signal.receivers`` before building a payload). O(1)."""
        if self._journals:
            return True
        signal = self._signals.get(event_type)
        return signal is not None and bool(signal.receivers)

    def emit(self, event: Event) -> None:
        """Dispatch ``event`` through its signal (queued if called from inside a receiver)."""
        if self._ended:
            log.warning("event_after_run_ended_dropped", event_type=type(event).__name__, step=event.step)
            return
        if self._dispatching:
            self._queue.append(event)  # emitted by a receiver: dispatched after the current event
            return
        if self._left:  # emitted during a dispatch a critical observer aborted: they come first
            self._queue.extend(self._left)
            self._left.clear()
        pending = self._policy.pending
        if pending:
            # left by a dispatch that a critical observer or a KeyboardInterrupt aborted: report them first
            self._queue.extend(self._take_pending_failures())
        self._dispatching = True
        try:
            if self._queue or isinstance(event, RunEnded):
                self._queue.append(event)
            else:
                self._dispatch(event)  # the common case (every per-step event): straight to the signal
                if pending:
                    self._queue.extend(self._take_pending_failures())
            self._drain()  # events the receivers emitted, in order
        finally:
            self._dispatching = False
            if self._queue:  # a critical observer or an interrupt aborted the dispatch: keep what was emitted
                self._left.extend(self._queue)
                self._queue.clear()
                log.warning("events_delayed_by_aborted_dispatch", event_types=[type(e).__name__ for e in self._left],
                            hint="they are delivered (and recorded) before the next event")

    def _drain(self) -> None:
        while self._queue:
            current = self._queue.popleft()
            self._dispatch(current)
            if isinstance(current, RunEnded):
                self._end()
                break
            if self._policy.pending:
                self._queue.extend(self._take_pending_failures())

    def _take_pending_failures(self) -> list[ObserverFailed]:
        failures = list(self._policy.pending)
        self._policy.pending.clear()
        return failures

    def _end(self) -> None:
        """RunEnded has reached every receiver: nothing more is dispatched (failures on it were logged already)."""
        self._ended = True
        self._policy.pending.clear()
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
                    self._policy.storage_failure(getattr(owner, "name", repr(journal)), owner, exc, self.ctx)
        signal = self._signals.get(type(event))
        if signal is not None and signal.receivers:
            signal.send(event, ctx=self.ctx)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def observers(self) -> tuple[Any, ...]:
        return tuple(self._observers)

    def close(self) -> None:
        """Run every observer's ``close()`` once (errors are logged, not raised), then disconnect every receiver."""
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
        for late in self._left:
            log.warning("event_never_delivered", event_type=type(late).__name__, step=late.step,
                        reason="emitted during a dispatch that was aborted, and no event came after it")
        self._left.clear()
        for signal in self._signals.values():
            signal._disconnect_all()
        self._journals.clear()
        self.ctx = None
