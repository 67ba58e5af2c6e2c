"""Replay a run's event log: debug a run without rerunning it, and ask "what if" of decisions made from events.

A notebook reads the log as typed events with :func:`wantrain.core.events.log.read`.

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
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
import tomli_w

from wantrain.app.config import load_config, to_plain
from wantrain.app.observers import (
    BUILT_IN,
    BY_KEY,
    build_observers,
    load_observer_class,
    observer_search_dirs,
    read_config_source,
    resolve_extra_observers,
)
from wantrain.core.bus import Bus, Priority
from wantrain.core.context import Context, DeviceMetrics, Live
from wantrain.core.control import Control
from wantrain.core.errors import UserError
from wantrain.core.events import Event, RunEnded, RunStarted
from wantrain.core.events.log import read, resolve_event_log
from wantrain.core.state import TrainState
from wantrain.core.trust import allowing_code, code_allowed
from wantrain.observers.alpha.report import alpha_whatif

__all__ = ["ReplayResult", "alpha_whatif", "read", "replay"]  # read: the event log; alpha_whatif: the table

log = structlog.get_logger("wantrain.replay")

# keys a what-if may change and have an effect: everything else was computed when the run trained
_REPLAYED_KEYS = ("observers.", "lora.alpha_schedule.")
_DEVICE_SIDE_KEYS = ("lora.alpha_schedule.window",)


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
           until: int | None = None, out: str | Path | None = None, allow_code: bool = False) -> ReplayResult:
    """Replay ``run_dir``'s event log into the observers its config (with ``overrides``) builds. ``observers``:
    names (the keys of ``wantrain.app.observers.BUILT_IN`` or a user observer's ``name``) to replay, default
    every replayable one but the progress line. Writes into ``out`` (default ``<run_dir>__replay_<time>`` beside
    the run), never into the run. ``allow_code``: import the run's users' observers (and any other code its config
    names), looked for beside the config the run was started from, as ``run`` did, then in the working directory
    and the installed packages (``wantrain.core.trust``; the CLI's ``--allow-code``)."""
    with allowing_code(allow_code):
        return _replay(Path(run_dir), observers, overrides, until, out)


def _replay(run_dir: Path, observers: Sequence[str] | None, overrides: Sequence[str], until: int | None,
            out: str | Path | None) -> ReplayResult:
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"'{run_dir}' is not a run directory (it has no config.toml); pass a directory that "
                        "`wantrain run` created")
    log_path = resolve_event_log(run_dir)
    next(read(log_path), None)  # a log of another schema version is refused before anything is written
    wanted = list(observers) if observers is not None else None
    overrides = list(overrides)
    notes = _override_notes(overrides)
    enable = [BY_KEY[n].flag for n in wanted or () if n in BY_KEY and BY_KEY[n].flag]
    if wanted is None or "progress" not in wanted:
        enable.append("observers.progress=false")
    cfg = load_config(run_dir / "config.toml", [*enable, *overrides])
    out_dir = _out_dir(run_dir, out)
    # Written into a hidden sibling and renamed into place when complete: a replay that fails (a damaged log, an
    # observer's error) leaves nothing in --out, not a partial output that reads like a finished one.
    work = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    try:
        result = _replay_into(work, out_dir, run_dir, log_path, cfg, wanted, overrides, until, notes)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if out_dir.is_dir():
        out_dir.rmdir()  # the empty folder --out named (_out_dir refuses any other)
    os.replace(work, out_dir)
    return result


def _replay_into(work: Path, out_dir: Path, run_dir: Path, log_path: Path, cfg: Any, wanted: list[str] | None,
                 overrides: list[str], until: int | None, notes: list[str]) -> ReplayResult:
    """The replay itself, writing into ``work`` (renamed to ``out_dir`` by the caller once it is complete)."""
    config_dir = read_config_source(run_dir)  # users' observers: beside the run's config first, as run looked
    cfg, unimported = _importable_extras(cfg, wanted, observer_search_dirs(config_dir))
    plain = to_plain(cfg)
    extra = resolve_extra_observers(cfg, config_dir)  # imports users' observers: their event types become readable
    built = build_observers(cfg, work, extra=extra, hparams=plain)
    chosen, skipped = _choose(built, wanted)
    skipped.extend(unimported)
    work.mkdir(parents=True)

    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(), run_dir=work)
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
    ended: RunEnded | None = None  # held back: a RunStarted after it means the run was resumed
    try:
        for event in read(log_path, until=until):
            if type(event) in emitted_types:
                recorded.append(event)
                continue
            if isinstance(event, RunEnded):
                ended = event
                continue
            if ended is not None:
                if isinstance(event, RunStarted):  # stopped (or failed) and resumed: one run for the observers
                    notes.append(f"the recorded run ended {ended.status} at step {ended.step} and was resumed; "
                                 "the replayed observers see one run and its last RunEnded")
                else:
                    bus.emit(ended)  # not a resume: as recorded (the bus drops what follows, with a warning)
                    count += 1
                ended = None
            if isinstance(event, RunStarted):
                event = attrs.evolve(event, run_dir=str(out_dir))  # the replay's folder, as it will be named
            ctx.state.step, last_step = event.step, event.step
            ctx.state.expert = getattr(event, "expert", ctx.state.expert)
            bus.emit(event)
            count += 1
            ctx.metrics = DeviceMetrics()  # values observers put are never gathered: the recorded ones are sent
            if ctx.control.stop_requested and not stop_noted:
                stop_noted = True
                notes.append(f"an observer asked to stop at step {event.step} ({ctx.control.stop_reason}); the "
                             "recorded run went on, and so does the replay")
        if ended is not None:
            ctx.state.step, last_step = ended.step, ended.step
            bus.emit(ended)
            count += 1
    finally:
        bus.close()
    # not config.toml: the replay folder is no run (`--resume auto` and the tools looking for runs pass it over)
    (work / "replay_config.toml").write_text(_toml(plain), encoding="utf-8")
    result = ReplayResult(out_dir, tuple(o.name for o in chosen), tuple(skipped), count, last_step,
                          tuple(recorded), tuple(regenerated), tuple(notes))
    summary = {"source": str(run_dir), "event_log": str(log_path), "overrides": overrides, "until": until,
               "observers": list(result.observers), "skipped": list(skipped), "events": count,
               "last_step": last_step, "notes": list(notes)}
    (work / "replay.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return result


def _importable_extras(cfg: Any, wanted: list[str] | None, search: tuple[Path, ...]) -> tuple[Any, list[str]]:
    """Users' observers that cannot be imported here (or may not: no ``--allow-code``) are left out with a note,
    unless ``--observers`` names them."""
    keep, notes = [], []
    where = ", ".join(f"'{d}'" for d in search)
    for i, spec in enumerate(cfg.observers.extra):
        try:
            load_observer_class(spec, key=f"observers.extra[{i}]", search_dirs=search)
            keep.append(spec)
        except UserError as exc:
            if wanted is not None and spec.rpartition(":")[2] in wanted:
                if not code_allowed():
                    raise
                raise UserError(f"{exc} (replay imports users' observers from {where} and the installed "
                                "packages)") from None
            notes.append(f"{spec}: not imported ({exc})")
    if len(keep) == len(cfg.observers.extra):
        return cfg, notes
    return attrs.evolve(cfg, observers=attrs.evolve(cfg.observers, extra=keep)), notes


def _choose(built: list[Any], wanted: list[str] | None) -> tuple[list[Any], list[str]]:
    by_name = {o.name: o for o in built}
    short = {row.observer_name: row.key for row in BUILT_IN}
    long = {row.key: row.observer_name for row in BUILT_IN}
    if wanted is not None:
        available = sorted(short.get(n, n) for n in by_name)
        for name in wanted:
            if long.get(name, name) not in by_name:
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
                        f"(built-in: {', '.join(row.key for row in BUILT_IN if row.replayable)})")
    return chosen, skipped


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
    return tomli_w.dumps(json.loads(json.dumps(plain, default=str)))
