'''The event catalogue: every event the core emits, where it fires, and what an observer may do there.

The loop, written as pseudocode with each event where it fires (``Trainer.run`` in ``core/loop.py`` is this, in
Python)::

    restore the checkpoint (resume)           # observers' load_state_dict() runs here, before RunStarted
    emit RunStarted                            # observers may: read ctx, request stop, evaluate the model
                                               #   (`with control.evaluation() as bring_in:` -- see below)
    optimizer.train()                          # only optimizers with modes (schedule-free)
    for step in start_step+1 .. total_steps:   # `step` counts optimizer steps, 1-based
        expert = adapter.expert_for_step(step) # None for single-transformer models
        if expert changed:
            adapter.activate(expert)           # inactive expert and its optimizer state leave the device
            emit ExpertSwitched
        for micro in 1 .. grad_accum:          # gradient accumulation
            emit StepStarted                   # may: request stop, set LR (applies at this step's optimizer step)
                                               #   set the generator state for this forward's draws
            emit BatchDrawn                    # what the global batch trains, every rank's rows (read only)
            loss = adapter.loss(batch, expert)     # forward
            emit LossComputed                  # ctx.live.loss holds the detached device loss: may accumulate it
                                               #   on the device; must NOT call .item()/float()/bool() on it
            (loss / grad_accum).backward()
            on OutOfMemory: zero grads, emit OutOfMemory, skip the rest of this step
                                               # may: request stop (else the core skips the step, and after
                                               #   train.max_consecutive_oom skipped steps in a row writes an
                                               #   emergency checkpoint and ends the run `failed`)
        average grads over the ranks (torchrun); norm = their global L2 norm
        emit GradsReady                        # grads accumulated, BEFORE clipping and the optimizer step;
                                               #   ctx.live.grad_norm holds `norm` (0-dim, on the device)
                                               # may: read grads (device ops only), request skip of this step
        apply LR requests; clip grads with `norm` (if train.clip_grad_norm)
        if not control.skip_step: optimizer.step(found_inf=non-finite loss or grad norm)
                                               # a non-finite step is skipped on the device, without a sync:
                                               #   one fused check per step writes the step's flag
        optimizer.zero_grad(); scheduler.step()
        emit OptimizerStepped                  # says whether the step was skipped (host-known reasons) and the LRs
                                               # may: evaluate the model (validation, samples) inside
                                               #   control.evaluation(): the core brings experts in with their
                                               #   optimizer state and puts the training expert back at exit;
                                               #   the sample observer then emits SamplesWritten (queued next)
        if too many out-of-memory steps in a row: emergency checkpoint; end `failed`
        if step is a log step:                 # every train.log_every steps, and the last step
            values = ctx.metrics.gather()      # THE one device->host transfer of the interval (with the
                                               #   interval's losses and non-finite flags: core.interval)
            emit MetricsLogged                 # host floats only: sinks write them (TensorBoard, JSONL, bar)
                                               # may: decide from the values; request an alpha transition
                                               #   (control.set_lora_alpha); emit its own events (AlphaChanged)
        apply model requests                   # control.set_lora_alpha: adapter.change_lora_alpha(..., optimizer)
                                               #   in the order asked, before any save of this step
        non-finite guard (log steps): stop `failed` after train.max_consecutive_nan non-finite steps in a row
        every 0.2 s, the requests of <run_dir>/inbox.jsonl (core.inbox: `wantrain ctl`, the page's buttons):
            emit ControlRequested                # one per request, recorded, so replay shows it; then the core
                                               #   acts: save -> control.request_save, stop -> request_stop;
                                               # sample / validate: the sample and validation observers run a
                                               #   round at this step (control.evaluation(), as at
                                               #   OptimizerStepped); others may only read it
        if step % save_every == 0 or control.save_now:
            saver.save(...); write checkpoint; emit CheckpointSaved   # in optimizer.eval() mode, then train()
        elif step % checkpoint.every == 0: write checkpoint; emit CheckpointSaved
        if control.stop_requested: break
    emit MetricsLogged                         # the partial interval, if the run stopped between log steps
    apply model requests                       # what its handlers requested
    saver.save(final); write checkpoint        # unless the run failed; optimizer.eval() mode, and it stays
    emit CheckpointSaved
    emit RunEnded                              # always, also after a failure (status says which)
    every observer's close() runs              # also after a crash

Whenever a passive observer raises: the error is logged, ObserverFailed is emitted after the current event has
reached every other observer, and the observer is disabled after ``Bus.max_failures`` failures. Nothing follows
RunEnded: a failure while handling it is only logged.

Rules for payloads: events are frozen, slotted attrs classes holding Python scalars and small host objects only.
Live objects (adapter, optimizer, the current loss tensor) are reached through the ``ctx`` handed to every
handler; ``ctx.live`` is cleared after each dispatch so no event keeps device tensors alive. Every step event
carries ``expert`` (``"high_noise"``, ``"low_noise"`` or ``None`` for single-transformer models).

Every event serialises to JSON with :func:`to_record` (a ``_type`` tag, a schema version) and back with
:func:`from_record`: the event recorder and ``wantrain replay`` use these.
'''

from __future__ import annotations

import typing
from typing import Any, Literal

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

SCHEMA_VERSION = 1


@attrs.frozen(slots=True, kw_only=True)
class Event:
    """Base of all events. ``step`` is the optimizer step the event belongs to (0 before the first step)."""

    step: int


@attrs.frozen(slots=True, kw_only=True)
class RunStarted(Event):
    """The run is assembled and about to take its first step. ``step`` is the step it starts after (0, or the
    resumed step)."""

    run_dir: str
    total_steps: int
    grad_accum: int
    experts: tuple[str | None, ...]
    log_every: int
    resumed_from: str | None = None  # the checkpoint a resumed run continues from


@attrs.frozen(slots=True, kw_only=True)
class ExpertSwitched(Event):
    """The trained expert changed before optimizer step ``step``; the previous one left the training device."""

    previous: str | None
    expert: str | None


@attrs.frozen(slots=True, kw_only=True)
class StepStarted(Event):
    """A micro-step begins. ``micro_step`` counts all micro-steps of the run (1-based); ``accumulation_index`` is
    1..grad_accum within the optimizer step; ``ends_optimizer_step`` is True on the last micro-step of an
    optimizer step; ``is_log_step`` tells observers that this optimizer step will log."""

    micro_step: int
    accumulation_index: int
    ends_optimizer_step: bool
    is_log_step: bool
    expert: str | None


@attrs.frozen(slots=True, kw_only=True)
class BatchDrawn(Event):
    """A micro-step's batch was drawn, before its forward: ``samples`` is what its global batch trains, every
    rank's rows (rank, clip path, first frame, frames), padding left out -- the data plug-in's ``batch["trained"]``
    (no event when a batch has none). A step skipped afterwards (out of memory, a stop between micro-steps) did not
    train them: its ``OutOfMemory`` or the run's end follows."""

    micro_step: int
    samples: tuple[tuple[int, str, int, int], ...]


@attrs.frozen(slots=True, kw_only=True)
class LossComputed(Event):
    """The forward pass of a micro-step produced its loss; ``ctx.live.loss`` holds it (detached, on the device)."""

    micro_step: int
    accumulation_index: int
    ends_optimizer_step: bool
    is_log_step: bool
    expert: str | None


@attrs.frozen(slots=True, kw_only=True)
class GradsReady(Event):
    """Gradients of optimizer step ``step`` are accumulated; clipping and the optimizer step have not run."""

    is_log_step: bool
    expert: str | None


@attrs.frozen(slots=True, kw_only=True)
class OptimizerStepped(Event):
    """The optimizer step ``step`` ran (or was skipped at an observer's request) and the scheduler stepped.
    ``lrs`` are the learning rates used, one per parameter group, in the optimizer's group order."""

    expert: str | None
    skipped: bool
    skip_reason: str | None
    lrs: tuple[float, ...]
    group_names: tuple[str, ...]
    is_log_step: bool


@attrs.frozen(slots=True, kw_only=True)
class MetricsLogged(Event):
    """Host values of a log step, gathered in one device->host transfer. ``values`` maps a metric name (for
    example ``train/loss``) to a float; ``elapsed_s`` is wall time since the run started."""

    expert: str | None
    values: dict[str, float]
    elapsed_s: float
    total_steps: int


@attrs.frozen(slots=True, kw_only=True)
class CheckpointSaved(Event):
    """Files were written: ``paths`` are the LoRA files (one per trained expert) of this save, ``checkpoint`` the
    resumable checkpoint directory written with them (None when checkpoints are off). An emergency or a
    checkpoint-only save has no LoRA paths."""

    paths: tuple[str, ...]
    final: bool
    reason: str
    checkpoint: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class SamplesWritten(Event):
    """The sample observer wrote this step's videos (``paths``, the mp4 files in prompt order), on rank 0.
    Emitted by that observer, queued after the event it sampled at (``RunStarted`` or ``OptimizerStepped``)."""

    paths: tuple[str, ...]


@attrs.frozen(slots=True, kw_only=True)
class OutOfMemory(Event):
    """The device ran out of memory in ``phase`` (``forward``, ``backward`` or ``optimizer``); the micro-batch's
    gradients were dropped. ``consecutive`` counts OOMs in a row."""

    micro_step: int
    expert: str | None
    phase: str
    consecutive: int
    message: str


@attrs.frozen(slots=True, kw_only=True)
class ObserverFailed(Event):
    """A passive observer raised while handling ``event_type``; training goes on. ``disabled`` is True when it
    reached the failure limit and receives no more events."""

    observer: str
    event_type: str
    error: str
    failures: int
    disabled: bool


@attrs.frozen(slots=True, kw_only=True)
class ControlRequested(Event):
    """A person asked the running run for ``action`` (``save``, ``sample``, ``validate`` or ``stop``) through its
    inbox (``core.inbox``): ``source`` says from where (``ctl``, ``web``), ``request_id`` is the request's id.
    ``refused`` is None when the core acts on it, else why not (for example ``sample`` under torchrun, where every
    rank would have to agree on the step)."""

    action: str
    source: str
    request_id: str
    refused: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class RunEnded(Event):
    """The run is over: ``status`` is ``completed`` (all steps), ``stopped`` (an observer or a signal asked),
    ``aborted`` (a second Ctrl-C: ``KeyboardInterrupt``, nothing saved) or ``failed`` (an exception; ``reason``
    names it)."""

    status: Literal["completed", "stopped", "aborted", "failed"]
    reason: str | None


CATALOGUE: tuple[type[Event], ...] = (
    RunStarted,
    ExpertSwitched,
    StepStarted,
    BatchDrawn,
    LossComputed,
    GradsReady,
    OptimizerStepped,
    MetricsLogged,
    CheckpointSaved,
    SamplesWritten,
    OutOfMemory,
    ObserverFailed,
    ControlRequested,
    RunEnded,
)

_event_types: list[type[Event]] = list(CATALOGUE)
_converter: cattrs.Converter
_union: Any = None


def register_event_type(cls: type[Event]) -> type[Event]:
    """Register an observer's own event class so the bus accepts it and the recorder can serialise it."""
    if not (isinstance(cls, type) and issubclass(cls, Event) and attrs.has(cls)):
        raise TypeError(f"{cls!r} is not an attrs subclass of wantrain.core.events.Event")
    if cls not in _event_types:
        _event_types.append(cls)
        _rebuild_converter()
    return cls


def _rebuild_converter() -> None:
    global _converter, _union
    conv = cattrs.Converter()
    union = typing.Union[tuple(_event_types)]
    configure_tagged_union(union, conv, tag_name="_type")
    _converter, _union = conv, union


_rebuild_converter()


def known_event_types() -> tuple[type[Event], ...]:
    return tuple(_event_types)


# The catalogue's events hold JSON-ready values only (scalars, tuples of scalars, a dict of floats): their records
# are read off the slots directly, the same dict cattrs builds at a fraction of its cost (the recorder does this for
# every event). Registered event types may hold anything cattrs can unstructure and go through it.
_PLAIN_FIELDS = {cls: tuple(f.name for f in attrs.fields(cls)) for cls in CATALOGUE}


def to_record(event: Event, seq: int, wall_time: float) -> dict[str, Any]:
    """The JSON-ready record of ``event``: its fields, ``_type``, ``seq``, ``wall_time`` and ``schema``."""
    fields = _PLAIN_FIELDS.get(type(event))
    if fields is not None:
        record = {name: getattr(event, name) for name in fields}
        record["_type"] = type(event).__name__
    else:
        record = _converter.unstructure(event, unstructure_as=_union)
    record["seq"] = seq
    record["wall_time"] = wall_time
    record["schema"] = SCHEMA_VERSION
    return record


def from_record(record: dict[str, Any]) -> Event:
    """Rebuild an event from :func:`to_record` output (extra bookkeeping keys are ignored)."""
    data = {k: v for k, v in record.items() if k not in ("seq", "wall_time", "schema")}
    return _converter.structure(data, _union)


__all__ = [
    "CATALOGUE",
    "SCHEMA_VERSION",
    "BatchDrawn",
    "CheckpointSaved",
    "ControlRequested",
    "Event",
    "ExpertSwitched",
    "GradsReady",
    "LossComputed",
    "MetricsLogged",
    "ObserverFailed",
    "OptimizerStepped",
    "OutOfMemory",
    "RunEnded",
    "RunStarted",
    "SamplesWritten",
    "StepStarted",
    "from_record",
    "known_event_types",
    "register_event_type",
    "to_record",
]
