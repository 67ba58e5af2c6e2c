"""Resuming a run: which config changes a checkpoint may continue under (:data:`RESUME_RULES`), the config hash a
checkpoint carries, finding, reading and checking the checkpoint ``--resume`` names, and the run directory's
housekeeping when a run continues in it (the previous config kept, stale temporaries removed, later checkpoints
set aside). ``wantrain.app.assemble`` calls these; nothing here builds a run.

A damaged checkpoint (``core.checkpoint.CheckpointDamaged``: a checksum, a tensor reference, the state tree's
schema, a tensor that does not fit the run, ``core.state_check``) is passed over with a warning naming it under
``--resume auto`` and refused in one line for a path. Whether a tree fits the run is known only once the model is
built: :func:`load_resume_point` checks everything else early, :func:`confirm_resume_point` the rest."""

from __future__ import annotations

import hashlib
import json
import re
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog

from wantrain.app.observers import read_config_file
from wantrain.core.atomic import atomic_write, remove_temporaries
from wantrain.core.checkpoint import (
    CheckpointDamaged,
    inspect_checkpoint,
    latest_complete,
    list_checkpoints,
    read_checkpoint,
    remove_stale_temporaries,
)
from wantrain.core.errors import UserError
from wantrain.core.parallel.distributed import checkpoint_world_size

log = structlog.get_logger("wantrain.run")

# -- resume compatibility -----------------------------------------------------------------------------------------
# What a checkpoint may continue under. The longest matching prefix decides; keys not listed warn.
RESUME_RULES: dict[str, str] = {
    # refused: the checkpoint's state would not mean the same thing (layout, data order, expert phase)
    "model.variant": "refuse", "model.experts": "refuse", "model.switch_every": "refuse",
    "model.expert_groups": "refuse", "model.sequence_degree": "refuse",  # the data shards and draws per rank
    "lora.rank": "refuse", "lora.alpha": "refuse", "data.": "refuse", "train.batch_size": "refuse",
    "train.grad_accum": "refuse", "run.seed": "refuse", "optimizer.type": "refuse",
    "lora.plus_lr_ratio": "refuse",  # LoRA+ on or off changes the optimizer's parameter groups
    "lora.type": "refuse", "lora.lokr_factor": "refuse", "lora.lokr_decompose_both": "refuse",  # the adapter's
    "lora.include": "refuse", "lora.exclude": "refuse",  # layout: the checkpoint's tensors would not fit
    # free: how the run is written, watched or placed in memory, not what it computes
    "run.output_dir": "free", "run.run_id": "free", "train.log_every": "free", "train.save_every": "free",
    "train.device": "free", "train.max_consecutive_oom": "free", "train.max_consecutive_nan": "free",
    "train.divergence_factor": "free",
    "observers.": "free", "checkpoint.": "free", "faults.": "free", "model.gradient_checkpointing": "free",
    "model.recompute": "free", "model.offload_device": "free", "lora.save_dtype": "free", "data.cache_dir": "free",
    "model.waiting_expert": "free",  # the waiting expert's base read back bit for bit (models/wan22/waiting.py)
    "lr_finder.": "free", "train.save_every_epochs": "free",
    "lora.init_from": "free", "lora.init_from_high_noise": "free", "lora.init_from_low_noise": "free",  # the
    # checkpoint's LoRA replaces the one a run starts from
    "validation.": "free", "sample.": "free",
    "model.parallel": "free", "model.shard_degree": "free",  # how the weights are placed; checkpoints hold whole
    # tensors in both layouts
}
"""Config keys by what resuming under a changed value does: ``refuse`` (the differing keys are listed), ``free``
(silent); every other key (LR, schedule, step budget, model paths, timestep sampling, ...) is allowed with a
warning. ``faults.*`` is a testing aid and never part of the config hash."""


AUTO_MAY_CHANGE = frozenset({"train.max_steps", "train.max_epochs"})
"""The keys of the ``warn`` class that ``--resume auto`` resumes under a changed value (the step budget: the
continue line of a stopped run passes ``--max-steps``); another such change needs the run directory given on
purpose (``--resume RUN_DIR``), so that auto never continues a run as something it was not."""


def resume_rule(key: str) -> str:
    best = ""
    for prefix in RESUME_RULES:
        if (key == prefix or (prefix.endswith(".") and key.startswith(prefix))) and len(prefix) > len(best):
            best = prefix
    return RESUME_RULES[best] if best else "warn"


def flatten_config(plain: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``; lists (``data.datasets``) stay one value."""
    out: dict[str, Any] = {}
    for key, value in plain.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_hash(plain: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of the keys a checkpoint depends on (the ``refuse`` class of :data:`RESUME_RULES`)."""
    relevant = {k: v for k, v in sorted(flatten_config(plain).items()) if resume_rule(k) == "refuse"}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compare_configs(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused differences, warned differences) between a checkpoint's config and the current one, as
    ``key: old -> new`` strings."""
    a, b = flatten_config(saved), flatten_config(current)
    refused, warned = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        rule = resume_rule(key)
        text = f"{key}: {_short(a.get(key))} -> {_short(b.get(key))}"
        if rule == "refuse":
            refused.append(text)
        elif rule == "warn":
            warned.append(text)
    return refused, warned


def _short(value: Any) -> str:
    text = "unset" if value is None else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


# -- finding the checkpoint to resume from --------------------------------------------------------------------------
@attrs.frozen
class ResumePoint:
    checkpoint: Path
    run_dir: Path
    step: int
    tree: Any
    meta: dict[str, Any]
    warnings: tuple[str, ...] = ()
    passed_over: tuple[str, ...] = ()  # the torn and damaged checkpoints skipped on the way (in ``warnings`` too)
    # --resume auto: the older complete checkpoints to fall back to, newest first, should this one not fit the run
    # once the model is built (``confirm_resume_point``); None for a path (refused instead)
    fallbacks: tuple[Path, ...] | None = None


def _run_config(run_dir: Path) -> dict[str, Any]:
    try:
        with (run_dir / "config.toml").open("rb") as fh:
            run = tomllib.load(fh).get("run", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return run if isinstance(run, dict) else {}


def _is_run_dir_of(name: str, run_id: str | None) -> bool:
    """Whether ``name`` is a training run directory of ``run_id`` (``core.rundir``: ``<stamp>[__<run_id>][-N]``);
    the LR finder's ``..__lr_finder`` and replay's ``..__replay_<time>`` are not."""
    suffix = "" if run_id is None else re.escape(f"__{run_id}")
    return re.fullmatch(rf"\d{{8}}_\d{{6}}{suffix}(-\d+)?", name) is not None


def run_ended_completed(run_dir: Path) -> int | None:
    """The step a run directory's last session completed at (its log's last ``run_started`` followed by a
    ``run_ended`` with status ``completed``), or None: unfinished (stopped, failed, killed) or no log."""
    completed = None
    try:
        with (run_dir / "log.jsonl").open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if '"run_started"' not in line and '"run_ended"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == "run_started":
                    completed = None
                elif record.get("event") == "run_ended":
                    completed = record.get("step") if record.get("status") == "completed" else None
    except OSError:
        return None
    return completed if isinstance(completed, int) else None


def _same_file(recorded: str | None, config_file: Path | None) -> bool:
    if recorded is None or config_file is None:
        return recorded is None and config_file is None
    return Path(recorded) == Path(config_file).resolve()


def auto_run_dirs(cfg: Any, config_file: Path | None) -> list[Path]:
    """The run directories ``--resume auto`` may continue, newest first: training runs under ``run.output_dir``
    of the same ``run.name``, ``run.run_id`` and config file (``config_source.json``)."""
    root = Path(cfg.run.output_dir)
    runs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name, reverse=True) \
        if root.is_dir() else []
    return [d for d in runs if _is_run_dir_of(d.name, cfg.run.run_id)
            and _run_config(d).get("name") == cfg.run.name and _run_config(d).get("run_id") == cfg.run.run_id
            and _same_file(read_config_file(d), config_file)]


def resume_candidates(spec: str | Path, cfg: Any, config_file: Path | None = None) -> tuple[list[Path], list[str]]:
    """The checkpoint directories ``--resume`` may mean, in the order to try them, and warnings about torn
    checkpoints passed over.

    ``auto``: the complete checkpoints of the newest unfinished run (:func:`auto_run_dirs`: same ``run.name``,
    ``run.run_id`` and config file ``config_file``) that holds one, newest first, then those of older unfinished
    such runs (a damaged one is passed over, see :func:`load_resume_point`); a completed run ends the search and,
    when nothing was found before it, is refused naming how to continue it on purpose. The run picked is named in
    the log before any checkpoint is read. A path: a checkpoint directory, or a run directory (its latest complete
    checkpoint); exactly one candidate.
    """
    warnings: list[str] = []

    def torn_note(torn: Sequence[Any]) -> None:
        warnings.extend(f"skipped torn checkpoint '{c.path}': {c.problem}" for c in torn)

    if str(spec) == "auto":
        root = Path(cfg.run.output_dir)
        found: list[Path] = []
        for run_dir in auto_run_dirs(cfg, config_file):
            done = run_ended_completed(run_dir)
            if done is not None:
                if found:
                    break
                raise UserError(
                    f"--resume auto: the latest run of this config, '{run_dir}', completed at step {done}; "
                    f"--resume auto continues only an unfinished run. To train it further on purpose: --resume "
                    f"'{run_dir}' --max-steps N (N > {done}); to start a new run, leave out --resume"
                )
            complete = [c.path for c in reversed(list_checkpoints(run_dir / "checkpoints")) if c.complete]
            if not found:
                best, torn = latest_complete(run_dir / "checkpoints")
                torn_note(torn)
                if best is None:
                    warnings.append(f"run '{run_dir.name}' has no complete checkpoint; looked at older runs")
                else:
                    log.info("resume_auto_picked", run_dir=str(run_dir), checkpoint=str(best.path))
            found.extend(complete)
        if found:
            return found, warnings
        who = (f"run id {cfg.run.run_id!r}" if cfg.run.run_id else "no run id") + (
            f", config file '{config_file}'" if config_file is not None else "")
        raise UserError(
            f"--resume auto: no complete checkpoint of a run named {cfg.run.name!r} ({who}) left unfinished under "
            f"'{root}'; start without --resume, or pass --resume PATH (a run directory or a checkpoint directory)"
        )
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"--resume {str(spec)!r}: no such file or directory; pass 'auto', a run directory or a "
                        "checkpoint directory (run_dir/checkpoints/step_NNNNNN)")
    if (path / "checkpoints").is_dir():
        best, torn = latest_complete(path / "checkpoints")
        torn_note(torn)
        if best is None:
            raise UserError(f"--resume '{path}': the run directory holds no complete checkpoint")
        return [best.path], warnings
    info = inspect_checkpoint(path)
    if info.step < 0:
        raise UserError(f"--resume '{path}' is neither a run directory nor a checkpoint directory (step_NNNNNN)")
    if not info.complete:
        raise UserError(f"--resume '{path}': the checkpoint is torn ({info.problem}); pass an earlier one or 'auto'")
    return [path], warnings


def load_resume_point(spec: str | Path, cfg: Any, plain: dict[str, Any], *,
                      expect: Callable[[Any], str | None] | None = None,
                      config_file: Path | None = None) -> ResumePoint:
    """Find, read, verify and check a checkpoint against the config (and, given ``expect``, against the run:
    ``expect(tree)`` returns a problem or None). A damaged checkpoint (``CheckpointDamaged``: checksums, tensor
    references, the state tree's schema, a tensor the run cannot take) is passed over with a warning naming it
    under ``auto`` and refused in one line for a path; a config that differs is refused either way, naming the
    differing keys; under ``auto``, so is one that differs in a key that may change only on purpose
    (:data:`AUTO_MAY_CHANGE`: pass the run directory to resume with the change)."""
    candidates, warnings = resume_candidates(spec, cfg, config_file)
    return _first_usable(candidates, warnings, plain, expect, auto=str(spec) == "auto")


def confirm_resume_point(point: ResumePoint, plain: dict[str, Any],
                         expect: Callable[[Any], str | None]) -> ResumePoint:
    """``point`` if its tree fits the run (``expect``, which needs the model: called once it is built), else,
    under ``--resume auto``, the newest older checkpoint that does (a warning names the one passed over)."""
    problem = expect(point.tree)
    if problem is None:
        return point
    _blame_config(point.checkpoint, point.meta.get("config"), plain, problem)
    if point.fallbacks is None:  # a path: refused
        raise CheckpointDamaged(point.checkpoint, problem)
    passed = [*point.passed_over, f"skipped damaged checkpoint '{point.checkpoint}': {problem}"]
    return _first_usable(list(point.fallbacks), passed, plain, expect, auto=True,
                         damaged=[(point.checkpoint, problem)])


def _first_usable(candidates: list[Path], passed: list[str], plain: dict[str, Any],
                  expect: Callable[[Any], str | None] | None, *, auto: bool,
                  damaged: list[tuple[Path, str]] | None = None) -> ResumePoint:
    damaged = list(damaged or [])
    for i, path in enumerate(candidates):
        try:
            loaded = read_checkpoint(path)
            saved_config = loaded.meta.get("config")
            if not isinstance(saved_config, dict):
                raise UserError(f"checkpoint '{path}' holds no config; it was not written by `wantrain run`")
            refused, warned = compare_configs(saved_config, plain)
            if refused:
                raise UserError(
                    f"checkpoint '{path}' was trained with another config; these keys differ and cannot change on "
                    "resume: " + "; ".join(refused) + " (restore them, or start a new run)"
                )
            on_purpose = [w for w in warned if w.split(":")[0] not in AUTO_MAY_CHANGE]
            if auto and on_purpose:
                raise UserError(
                    f"--resume auto: run '{path.parent.parent}' was trained with another config: "
                    + "; ".join(on_purpose) + f"; to resume it with these changes on purpose pass --resume "
                    f"'{path.parent.parent}', or restore them, or start a new run without --resume"
                )
            problem = expect(loaded.tree) if expect is not None else None
            if problem is not None:
                _blame_config(path, saved_config, plain, problem)
                raise CheckpointDamaged(path, problem)
        except CheckpointDamaged as exc:
            if not auto:
                raise
            passed.append(f"skipped damaged checkpoint '{path}': {exc.problem}")
            damaged.append((path, exc.problem))
            continue
        notes = (*passed, *(f"resuming with a changed {w}" for w in warned))
        return ResumePoint(path, path.parent.parent, loaded.step, loaded.tree, loaded.meta, notes,
                           passed_over=tuple(passed), fallbacks=tuple(candidates[i + 1:]) if auto else None)
    (newest, problem), *older = damaged
    raise UserError(f"--resume auto: every complete checkpoint found is damaged: '{newest}' ({problem})"
                    + (f" and {len(older)} older ones" if older else "") + "; start a new run")


def _blame_config(path: Path, saved_config: Any, plain: dict[str, Any], problem: str) -> None:
    """A tensor that does not fit the run while the checkpoint's own config differs in the model, LoRA or
    optimizer settings: the change is the cause (a ``UserError`` naming the keys), not damage."""
    if not isinstance(saved_config, dict):
        return
    a, b = flatten_config(saved_config), flatten_config(plain)
    changed = [f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in sorted(set(a) | set(b))
               if k.split(".")[0] in ("model", "lora", "optimizer") and a.get(k) != b.get(k)]
    if changed:
        raise UserError(f"checkpoint '{path}' does not fit this run ({problem}) and its config differs: "
                        + "; ".join(changed) + " (resume with the settings the run was started with)")


def check_resume_world_size(point: ResumePoint, world_size: int, *, sharded: bool = False,
                            expert_groups: int = 1) -> str | None:
    """Refuse a checkpoint written by another number of ranks: each rank's data position and random streams are
    its own, so they cannot be split or merged exactly. With ``model.parallel = "fsdp"`` (``sharded``) a run may
    resume on fewer or more ranks: its checkpoint holds the whole LoRA and optimizer state, which the new layout
    reshards (a shard degree that does not divide the new ranks is refused by ``preflight.check_parallel``); rank
    ``r`` continues rank ``r``'s streams, and the data the interrupted epoch's samples not yet trained, regrouped
    into global batches of ``train.batch_size`` x the new world size (``data.regroup``: each once); a rank the
    checkpoint never had starts from rank 0's counters and random streams (every rank draws the whole global
    batch's timesteps and noise from one stream and keeps its rows). Returns that note, for the log.
    ``expert_groups`` > 1 (sharded or not): refused, the hint says why."""
    saved = checkpoint_world_size(point.tree)
    if saved == world_size:
        return None

    def launch(n: int) -> str:
        return "one process (wantrain run)" if n == 1 else f"{n} processes (torchrun, {n} ranks in all)"
    if sharded:
        low, high = sorted((world_size, saved))
        which = f"rank {low}" if high - low == 1 else f"ranks {low}..{high - 1}"
        one = high - low == 1
        streams = (f"the random streams of {which} end" if world_size < saved
                   else f"{which} {'continues' if one else 'continue'} rank 0's random streams (every rank draws the "
                        "global batch's timesteps and noise from the same stream)")
        return (f"checkpoint '{point.checkpoint}' was written by {launch(saved)}, this run has {world_size}: the "
                f"LoRA, optimizer, schedule and counters continue exactly; {streams}, and the interrupted epoch's "
                f"samples not yet trained are regrouped into global batches {world_size}/{saved} the size (each "
                "trained once)")
    hint = (f" (with model.expert_groups = {expert_groups} each rank's group and data follow from the number of "
            "ranks)" if expert_groups > 1 else " (model.parallel = 'fsdp' resumes on another number of ranks)")
    raise UserError(
        f"checkpoint '{point.checkpoint}' was written by {launch(saved)} and this run has {world_size}; resume "
        f"with {launch(saved)}, or start a new run{hint}"
    )


# -- the run directory on resume -----------------------------------------------------------------------------------
def keep_previous_config(run_dir: Path, plain: dict[str, Any], step: int) -> None:
    """On resume with a changed config, keep the one the run had as ``config.until_step_NNNNNN.toml``: a copy
    (``core.atomic``), so ``config.toml`` is never missing or partial, whatever fails next; the caller then replaces
    it atomically. ``--resume auto`` finds a run by its ``config.toml``."""
    path = run_dir / "config.toml"
    try:
        content = path.read_bytes()
        old = tomllib.loads(content.decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return
    if old != json.loads(json.dumps(plain, default=str)):
        target = run_dir / f"config.until_step_{step:06d}.toml"
        if not target.exists():
            atomic_write(target, content, what="run file")


def set_aside_later_checkpoints(directory: Path, step: int) -> None:
    """Checkpoints newer than the one resumed from belong to an abandoned continuation: rename them out of the
    ``step_*`` namespace (never deleted) so that ``--resume auto`` does not pick them later."""
    stamp = time.strftime("%Y%m%d_%H%M%S")
    for c in list_checkpoints(directory):
        if c.complete and c.step > step:
            c.path.replace(c.path.with_name(f"superseded_{c.path.name}_{stamp}"))
            log.warning("checkpoint_set_aside", path=str(c.path), reason=f"resumed from step {step}")


def tidy_for_resume(run_dir: Path, step: int) -> None:
    """Before a run continues in ``run_dir`` from ``step`` (rank 0, holding the run directory's lock): remove what an
    interrupted save left (half-written checkpoints, unnamed LoRA or run files), put back a complete checkpoint a
    kill left under its rotation name, and set aside the checkpoints of the abandoned continuation."""
    remove_stale_temporaries(run_dir / "checkpoints")
    remove_temporaries(run_dir)  # a LoRA file, config.toml, preflight.json an interrupted write left unnamed
    set_aside_later_checkpoints(run_dir / "checkpoints", step)
