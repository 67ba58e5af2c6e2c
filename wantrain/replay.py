"""Replay a run's event log: debug a run without rerunning it, and ask "what if" of decisions made from events.

A notebook reads the log as typed events::

    from wantrain.replay import read
    for event in read("runs/20261130_101500"):        # a run directory, events.jsonl or events.jsonl.gz
        ...

:func:`replay` (``wantrain replay RUN_DIR``) rebuilds the run's observers from its resolved config
(``<run_dir>/config.toml`` plus overrides), keeps those that declare ``replayable = True`` and sends them the
recorded events through a fresh :class:`~wantrain.core.bus.Bus`, with a context that has no live model (adapter,
optimizer, scheduler and ``ctx.live`` are empty). What they write goes to a new directory; the run directory is
only read. Events of the types a replayed observer declares in ``emits`` (the alpha controller's
``AlphaChanged``) are not resent: the observer regenerates them, and :class:`ReplayResult` holds both the
recorded and the replayed ones, which :func:`alpha_whatif` sets side by side.

What replay cannot do: change anything that was computed on the device. Every logged value (losses, window
statistics, norms) is the recorded one; after the first transition that a what-if moves, the recorded values
come from a run whose alpha differed from the replayed schedule's (docs/replay.md).

Robustness of :func:`read`: a torn last line (a crash mid-write) is skipped with a warning; a record of another
schema version stops with one line (:class:`~wantrain.core.errors.UserError`); a record of an event type this
process does not know (a user's own, whose module is not imported) is skipped with one warning per type.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import structlog

from wantrain.core.errors import UserError
from wantrain.core.events import SCHEMA_VERSION, Event, RunStarted, from_record, known_event_types
from wantrain.observers.event_recorder import EVENT_LOG_NAMES, find_event_log, iter_log_lines

log = structlog.get_logger("wantrain.replay")

OBSERVER_NAMES = {
    "run_log": "RunLog", "tensorboard": "TensorBoardWriter", "jsonl": "JsonlMetrics", "progress": "ProgressLine",
    "alpha": "AlphaController", "memory_probe": "MemoryProbe", "norms": "Norms", "adaptive_lr": "adaptive_lr",
}
"""``--observers`` names of the built-in observers -> the observer's ``name``. A user's observer (``observers.extra``)
is named by its ``name`` (the class name unless it sets one)."""

_ENABLE = {"tensorboard": "observers.tensorboard=true", "jsonl": "observers.jsonl=true",
           "progress": "observers.progress=true", "memory_probe": "observers.memory_probe=true",
           "norms": "observers.norms=true"}

# keys a what-if may change and have an effect: everything else was computed when the run trained
_REPLAYED_KEYS = ("observers.", "lora.alpha_schedule.")
_DEVICE_SIDE_KEYS = ("lora.alpha_schedule.window",)


# -- reading --------------------------------------------------------------------------------------------------------
def read(path: str | Path, *, until: int | None = None) -> Iterator[Event]:
    """Yield the typed events of an event log (a run directory, ``events.jsonl`` or ``events.jsonl.gz``), in the
    order they were dispatched; ``until``: stop after the events of that optimizer step."""
    path = _log_path(Path(path))
    unknown: dict[str, int] = {}
    known = {t.__name__ for t in known_event_types()}
    for number, line, complete in iter_log_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if not complete:
                log.warning("torn_last_line_skipped", path=str(path), line=number)
                break
            raise UserError(f"event log '{path}' line {number} is not JSON; the log is damaged") from None
        if not complete:  # valid JSON but the newline never made it: the writer died before finishing the record
            log.warning("torn_last_line_skipped", path=str(path), line=number)
            break
        if not isinstance(record, dict) or "_type" not in record:
            raise UserError(f"event log '{path}' line {number} is not an event record (no '_type')")
        if record.get("schema") != SCHEMA_VERSION:
            raise UserError(
                f"event log '{path}' has schema version {record.get('schema')!r} (line {number}); this wantrain "
                f"reads version {SCHEMA_VERSION}: replay it with the wantrain version that recorded it"
            )
        kind = record["_type"]
        if kind not in known:
            if kind not in unknown:
                log.warning("unknown_event_type_skipped", event_type=kind, path=str(path), line=number,
                            hint="an observer's own event: import the module that registers it to read it")
            unknown[kind] = unknown.get(kind, 0) + 1
            continue
        if until is not None and record.get("step", 0) > until:
            break
        try:
            event = from_record(record)
        except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:  # fields do not fit the class
            raise UserError(f"event log '{path}' line {number}: a {kind} record does not fit its event class "
                            f"({type(exc).__name__}: {exc})") from None
        yield event
    for kind, count in unknown.items():
        if count > 1:
            log.warning("unknown_event_type_skipped_total", event_type=kind, records=count)


def _log_path(path: Path) -> Path:
    if path.is_dir():
        found = find_event_log(path)
        if found is None:
            raise UserError(
                f"'{path}' holds no event log ({' or '.join(EVENT_LOG_NAMES.values())}); the run was trained with "
                "observers.record_events = false"
            )
        return found
    if not path.is_file():
        raise UserError(f"event log '{path}' does not exist (pass a run directory or its events.jsonl[.gz])")
    return path


# -- replaying ------------------------------------------------------------------------------------------------------
@attrs.frozen
class ReplayResult:
    """What a replay did. ``recorded``/``replayed``: the events of the types the replayed observers emit
    (``AlphaChanged``), as recorded and as regenerated."""

    out_dir: Path
    observers: tuple[str, ...]
    skipped: tuple[str, ...]  # one note per observer left out
    events: int
    last_step: int
    recorded: tuple[Event, ...]
    replayed: tuple[Event, ...]
    notes: tuple[str, ...]


def replay(run_dir: str | Path, *, observers: Sequence[str] | None = None, overrides: Sequence[str] = (),
           until: int | None = None, out: str | Path | None = None) -> ReplayResult:
    """Replay ``run_dir``'s event log into the observers its config (with ``overrides``) builds. ``observers``:
    names (:data:`OBSERVER_NAMES` or a user observer's ``name``) to replay, default every replayable one but the
    progress line. Writes into ``out`` (default ``<run_dir>__replay_<time>`` beside the run), never into the run."""
    from wantrain.config import load_config, to_plain
    from wantrain.core.bus import Bus, Priority
    from wantrain.core.context import Context, DeviceMetrics, Live
    from wantrain.core.control import Control
    from wantrain.core.state import TrainState
    from wantrain.observers import build_observers, resolve_extra_observers

    run_dir = Path(run_dir).resolve()
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"'{run_dir}' is not a run directory (it has no config.toml); pass a directory that "
                        "`wantrain run` created")
    log_path = _log_path(run_dir)
    next(read(log_path), None)  # a log of another schema version is refused before anything is written
    wanted = list(observers) if observers is not None else None
    overrides = list(overrides)
    notes = _override_notes(overrides)
    enable = [_ENABLE[n] for n in wanted or () if n in _ENABLE]
    if wanted is None or "progress" not in wanted:
        enable.append("observers.progress=false")
    cfg = load_config(run_dir / "config.toml", [*enable, *overrides])
    out_dir = _out_dir(run_dir, out)
    cfg, unimported = _importable_extras(cfg, wanted)
    plain = to_plain(cfg)
    extra = resolve_extra_observers(cfg, None)  # imports users' observers: their event types become readable
    built = build_observers(cfg, out_dir, extra=extra, hparams=plain)
    chosen, skipped = _choose(built, wanted)
    skipped.extend(unimported)
    out_dir.mkdir(parents=True, exist_ok=True)

    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(), run_dir=out_dir)
    bus = Bus(ctx)
    emitted_types: set[type[Event]] = set()
    for observer in chosen:
        bus.attach(observer)
        emitted_types.update(getattr(observer, "emits", ()))
    regenerated: list[Event] = []
    for event_type in emitted_types:
        bus.subscribe(event_type, lambda event, _ctx: regenerated.append(event), name="replay",
                      priority=Priority.RECORDER)
    recorded: list[Event] = []
    count, last_step, stop_noted = 0, 0, False
    try:
        for event in read(log_path, until=until):
            if type(event) in emitted_types:
                recorded.append(event)
                continue
            if isinstance(event, RunStarted):
                event = attrs.evolve(event, run_dir=str(out_dir))  # observers that write there write the replay's
            ctx.state.step, last_step = event.step, event.step
            ctx.state.expert = getattr(event, "expert", ctx.state.expert)
            bus.emit(event)
            count += 1
            ctx.metrics = DeviceMetrics()  # values observers put are never gathered: the recorded ones are sent
            if ctx.control.stop_requested and not stop_noted:
                stop_noted = True
                notes.append(f"an observer asked to stop at step {event.step} ({ctx.control.stop_reason}); the "
                             "recorded run went on, and so does the replay")
    finally:
        bus.close()
    # not config.toml: the replay folder is no run (`--resume auto` and the tools looking for runs pass it over)
    (out_dir / "replay_config.toml").write_text(_toml(plain), encoding="utf-8")
    result = ReplayResult(out_dir, tuple(o.name for o in chosen), tuple(skipped), count, last_step,
                          tuple(recorded), tuple(regenerated), tuple(notes))
    summary = {"source": str(run_dir), "event_log": str(log_path), "overrides": overrides, "until": until,
               "observers": list(result.observers), "skipped": list(skipped), "events": count,
               "last_step": last_step, "notes": list(notes)}
    (out_dir / "replay.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return result


def _importable_extras(cfg: Any, wanted: list[str] | None) -> tuple[Any, list[str]]:
    """Users' observers that cannot be imported here are left out with a note, unless ``--observers`` names them."""
    from wantrain.observers import load_observer_class

    keep, notes = [], []
    for i, spec in enumerate(cfg.observers.extra):
        try:
            load_observer_class(spec, key=f"observers.extra[{i}]", search_dirs=(Path.cwd(),))
            keep.append(spec)
        except UserError as exc:
            if wanted is not None and spec.rpartition(":")[2] in wanted:
                raise UserError(f"{exc} (replay imports users' observers from the working directory and the "
                                "installed packages)") from None
            notes.append(f"{spec}: not imported ({exc})")
    if len(keep) == len(cfg.observers.extra):
        return cfg, notes
    return attrs.evolve(cfg, observers=attrs.evolve(cfg.observers, extra=keep)), notes


def _choose(built: list[Any], wanted: list[str] | None) -> tuple[list[Any], list[str]]:
    by_name = {o.name: o for o in built}
    short = {v: k for k, v in OBSERVER_NAMES.items()}
    if wanted is not None:
        available = sorted(short.get(n, n) for n in by_name)
        for name in wanted:
            if OBSERVER_NAMES.get(name, name) not in by_name:
                hint = (" (the run's lora.alpha_schedule is not enabled)" if name == "alpha" else "")
                raise UserError(f"--observers: {name!r} is not an observer of this run{hint}; available: "
                                f"{', '.join(available)}")
    chosen, skipped = [], []
    for observer in built:
        label = short.get(observer.name, observer.name)
        if wanted is not None and label not in wanted and observer.name not in wanted:
            continue
        if getattr(observer, "replayable", False):
            chosen.append(observer)
        else:
            skipped.append(f"{label}: not replayable (it reads the live model, optimizer or device)")
    if not chosen:
        raise UserError("no replayable observer selected; replayable ones declare `replayable = True` "
                        f"(built-in: {', '.join(k for k in OBSERVER_NAMES if k in _REPLAYABLE_BUILTINS)})")
    return chosen, skipped


_REPLAYABLE_BUILTINS = ("run_log", "tensorboard", "jsonl", "progress", "alpha")


def _out_dir(run_dir: Path, out: str | Path | None) -> Path:
    if out is None:
        target = run_dir.with_name(f"{run_dir.name}__replay_{time.strftime('%Y%m%d_%H%M%S')}")
        n = 1
        while target.exists():
            n += 1
            target = run_dir.with_name(f"{run_dir.name}__replay_{time.strftime('%Y%m%d_%H%M%S')}_{n}")
    else:
        target = Path(out).expanduser().resolve()
        if target == run_dir or run_dir in target.parents:
            raise UserError(f"--out '{target}' is inside the run directory; replay never writes into the run it "
                            "replays: pass a folder outside it")
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise UserError(f"--out '{target}' exists and is not an empty folder; pass a new folder")
    return target


def _override_notes(overrides: list[str]) -> list[str]:
    notes = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key.startswith(_DEVICE_SIDE_KEYS):
            notes.append(f"{key} is computed on the device while training: the replay uses the recorded statistics")
        elif not key.startswith(_REPLAYED_KEYS):
            notes.append(f"{key} changes what training computed; replay does not train, so only observers that read "
                         "it from the config see the new value")
    return notes


def _toml(plain: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(json.loads(json.dumps(plain, default=str)))


# -- the alpha what-if ----------------------------------------------------------------------------------------------
def alpha_whatif(result: ReplayResult) -> str:
    """Per expert, the recorded ``AlphaChanged`` transitions beside the replayed ones: step, phase change and the
    statistics at that step. Empty when the alpha controller was not replayed."""
    from wantrain.observers.alpha_controller import AlphaChanged, expert_key

    recorded = [e for e in result.recorded if isinstance(e, AlphaChanged)]
    replayed = [e for e in result.replayed if isinstance(e, AlphaChanged)]
    if "AlphaController" not in result.observers:
        return ""
    experts = list(dict.fromkeys(expert_key(e.expert) for e in [*recorded, *replayed]))
    lines = ["alpha transitions: recorded | replayed" + (" (identical)" if recorded == replayed else "")]
    lines.append("  statistics at that step: slope = loss_slope, r2 = loss_r2, cv = loss_cv, rate = "
                 "loss_improvement_rate, n = loss_samples, stab = gradient_stability")
    if not experts:
        lines.append("  none recorded, none replayed")
    for k in experts:
        rec = [e for e in recorded if expert_key(e.expert) == k]
        rep = [e for e in replayed if expert_key(e.expert) == k]
        lines.append(f"  {k}:")
        rows = []
        for i in range(max(len(rec), len(rep))):
            rows.append((_transition(rec[i]) if i < len(rec) else "-", _transition(rep[i]) if i < len(rep) else "-"))
            rows.append(("  " + _stats(rec[i]) if i < len(rec) else "", "  " + _stats(rep[i]) if i < len(rep) else ""))
        width = max((len(a) for a, _ in rows), default=0)
        lines.extend(f"    {a:<{width}} | {b}" for a, b in rows)
    return "\n".join(lines)


def _transition(event: Any) -> str:
    return f"step {event.step:>6}  {event.from_phase} -> {event.to_phase} (alpha {event.to_alpha:g})"


_SHORT = {"loss_slope": "slope", "loss_r2": "r2", "loss_cv": "cv", "loss_improvement_rate": "rate",
          "loss_samples": "n", "gradient_stability": "stab"}


def _stats(event: Any) -> str:
    parts = []
    for name, short in _SHORT.items():
        value = event.statistics.get(name, math.nan)
        parts.append(f"{short} {value:.3g}")
    return " ".join(parts)
