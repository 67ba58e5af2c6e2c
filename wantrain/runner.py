"""One place that assembles a run from a config: ``wantrain run``, resume, the LR finder (``wantrain.lr_finder_run``)
and torchrun (``core.distributed``) all go through :func:`prepare` and :meth:`PreparedRun.execute`; replay rebuilds
observers from the same config.

Python users call :func:`wantrain.train`::

    import wantrain
    outcome = wantrain.train("examples/quickstart.toml", overrides=["train.max_steps=50"])
    outcome = wantrain.train("examples/quickstart.toml", resume="auto")
    print(outcome.status, outcome.run_dir, outcome.exit_code)

Two phases, so that bad input never leaves anything behind:

* :func:`prepare` validates everything that can refuse the config (data folders, the model, observers, the LR
  schedule, the checkpoint to resume from and its compatibility) and writes nothing.
* :meth:`PreparedRun.execute` creates (or, on resume, reuses) the run directory, fills the cache, builds the
  optimizer, scheduler, observers and trainer, restores the checkpoint, and trains.

Exit codes (:data:`EXIT_CODES`): 0 completed, 1 failed, 2 bad input, 3 stopped (a signal or an observer's request;
a checkpoint was written and ``--resume auto`` continues), 130 aborted by a second Ctrl-C.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from wantrain.core.errors import UserError

log = structlog.get_logger("wantrain.run")

EXIT_CODES = {"completed": 0, "failed": 1, "stopped": 3}
"""Process exit code of ``wantrain run`` per run status (bad input is 2, an abort 130)."""

# -- resume compatibility -----------------------------------------------------------------------------------------
# What a checkpoint may continue under. The longest matching prefix decides; keys not listed warn.
RESUME_RULES: dict[str, str] = {
    # refused: the checkpoint's state would not mean the same thing (layout, data order, expert phase)
    "model.variant": "refuse", "model.experts": "refuse", "model.switch_every": "refuse",
    "lora.rank": "refuse", "lora.alpha": "refuse", "data.": "refuse", "train.batch_size": "refuse",
    "train.grad_accum": "refuse", "run.seed": "refuse", "optimizer.type": "refuse",
    # free: how the run is written, watched or placed in memory, not what it computes
    "run.output_dir": "free", "run.run_id": "free", "train.log_every": "free", "train.save_every": "free",
    "train.device": "free", "train.max_consecutive_oom": "free", "train.max_consecutive_nan": "free",
    "observers.": "free", "checkpoint.": "free", "faults.": "free", "model.gradient_checkpointing": "free",
    "model.offload_device": "free", "lora.save_dtype": "free", "data.cache_dir": "free",
    "lr_finder.": "free",
    "validation.": "free", "sample.": "free",
}
"""Config keys by what resuming under a changed value does: ``refuse`` (the differing keys are listed), ``free``
(silent); every other key (LR, schedule, step budget, model paths, timestep sampling, ...) is allowed with a
warning. ``faults.*`` is a testing aid and never part of the config hash."""


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


def _run_name(run_dir: Path) -> str | None:
    try:
        with (run_dir / "config.toml").open("rb") as fh:
            return tomllib.load(fh).get("run", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def find_resume_checkpoint(spec: str | Path, cfg: Any) -> tuple[Path, list[str]]:
    """The checkpoint directory ``--resume`` means, and warnings about torn checkpoints passed over.

    ``auto``: the newest run directory under ``run.output_dir`` whose ``run.name`` matches and that holds a complete
    checkpoint; its latest complete one. A path: a checkpoint directory, or a run directory (its latest complete
    checkpoint).
    """
    from wantrain.core.checkpoint import inspect_checkpoint, latest_complete

    warnings: list[str] = []

    def torn_note(torn: Sequence[Any]) -> None:
        warnings.extend(f"skipped torn checkpoint '{c.path}': {c.problem}" for c in torn)

    if str(spec) == "auto":
        root = Path(cfg.run.output_dir)
        runs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name, reverse=True) \
            if root.is_dir() else []
        for run_dir in runs:
            if _run_name(run_dir) != cfg.run.name:
                continue
            best, torn = latest_complete(run_dir / "checkpoints")
            torn_note(torn)
            if best is not None:
                return best.path, warnings
            warnings.append(f"run '{run_dir.name}' has no complete checkpoint; looked at older runs")
        raise UserError(
            f"--resume auto: no complete checkpoint of a run named {cfg.run.name!r} under '{root}'; start without "
            "--resume, or pass --resume PATH (a run directory or a checkpoint directory)"
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
        return best.path, warnings
    info = inspect_checkpoint(path)
    if info.step < 0:
        raise UserError(f"--resume '{path}' is neither a run directory nor a checkpoint directory (step_NNNNNN)")
    if not info.complete:
        raise UserError(f"--resume '{path}': the checkpoint is torn ({info.problem}); pass an earlier one or 'auto'")
    return path, warnings


def load_resume_point(spec: str | Path, cfg: Any, plain: dict[str, Any]) -> ResumePoint:
    """Find, read and check a checkpoint against the config; refuses with one line naming the differing keys."""
    from wantrain.core.checkpoint import read_checkpoint

    path, warnings = find_resume_checkpoint(spec, cfg)
    loaded = read_checkpoint(path)
    saved_config = loaded.meta.get("config")
    if not isinstance(saved_config, dict):
        raise UserError(f"checkpoint '{path}' holds no config; it was not written by `wantrain run`")
    refused, warned = compare_configs(saved_config, plain)
    if refused:
        raise UserError(
            f"checkpoint '{path}' was trained with another config; these keys differ and cannot change on resume: "
            + "; ".join(refused) + " (restore them, or start a new run)"
        )
    warnings.extend(f"resuming with a changed {w}" for w in warned)
    return ResumePoint(path, path.parent.parent, loaded.step, loaded.tree, loaded.meta, tuple(warnings))


def check_resume_world_size(point: ResumePoint, world_size: int) -> None:
    """Refuse a checkpoint written by another number of ranks: each rank's data position and random streams are
    its own, so they cannot be split or merged exactly."""
    from wantrain.core.distributed import checkpoint_world_size

    saved = checkpoint_world_size(point.tree)
    if saved != world_size:
        def launch(n: int) -> str:
            return "one process (wantrain run)" if n == 1 else f"{n} processes (torchrun, {n} ranks in all)"
        raise UserError(
            f"checkpoint '{point.checkpoint}' was written by {launch(saved)} and this run has {world_size}; resume "
            f"with {launch(saved)}, or start a new run"
        )


def _run_dir_from_rank0(message: str) -> Path:
    kind, _, text = message.partition(":")
    if kind == "error":
        raise UserError(text)
    return Path(text)


# -- signals ----------------------------------------------------------------------------------------------------------
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


# -- the assembly -----------------------------------------------------------------------------------------------------
@attrs.frozen
class RunOutcome:
    status: str
    reason: str | None
    steps: int
    run_dir: Path
    saved: tuple[str, ...]
    checkpoint: str | None = None
    lr_finder: tuple[str, ...] = ()  # the LR finder's summary lines (suggestions, warnings), when it ran
    lr_finder_dir: Path | None = None
    rank: int = 0

    @property
    def exit_code(self) -> int:
        """The status's code on rank 0. Other torchrun ranks exit 0 once their part is done, whatever the status:
        torchrun ends every other rank as soon as one exits non-zero, which could cut rank 0's last writes short;
        rank 0's code carries the outcome (torchrun itself then exits 1 for any non-zero code)."""
        return EXIT_CODES.get(self.status, 1) if self.rank == 0 else 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(
            f"config key 'train.device' = {name!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("config key 'train.device' asks for CUDA but no CUDA GPU is available; use 'auto' or 'cpu'")
    return device


def build_optimizer(cfg: Any, param_groups: list[dict[str, Any]], device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer over the adapter's groups (``wantrain.optimizers``; fused AdamW by default)."""
    from wantrain.optimizers import build_optimizer as build

    return build(cfg.optimizer, param_groups, device)


@attrs.define
class PreparedRun:
    """A validated run, nothing written yet. :meth:`execute` trains."""

    cfg: Any
    plain: dict[str, Any]
    config_dir: Path | None
    device: torch.device
    data: Any
    adapter: Any
    extra_observers: list[type]
    resume: ResumePoint | None = None
    # --lr-finder-then-train: the trainer state captured before the sweep, loaded into this run's trainer
    initial_state: Any = None
    validation_data: Any = None  # the [validation] clips (wantrain.observers.validation.build_validation_data)
    sync: Any = None  # core.distributed: SingleProcess, or ProcessGroupSync under torchrun

    def __attrs_post_init__(self) -> None:
        if self.sync is None:
            from wantrain.core.distributed import SingleProcess

            self.sync = SingleProcess()

    def execute(self, *, finder: Any = None, before_run: Callable[[Any], None] | None = None) -> RunOutcome:
        """Train (see the module docstring). A config with ``[lr_finder]`` enabled runs the range test instead
        (``wantrain.lr_finder_run``), which calls back here with ``finder`` (an ``LrFinder``): a run directory
        suffixed ``__lr_finder``, the sweep's length, no LoRA and no checkpoint. ``before_run(trainer)`` runs after
        the assembly, right before the first step."""
        import tomli_w

        from wantrain.cli.logs import configure_logging
        from wantrain.core.rundir import create_run_dir

        if finder is None and self.cfg.lr_finder.active:
            from wantrain.lr_finder_run import execute_lr_finder

            return execute_lr_finder(self)
        cfg, data, resume, sync = self.cfg, self.data, self.resume, self.sync
        if not sync.is_main:  # rank 0 alone creates the run directory and writes its files; the others learn it
            run_dir = _run_dir_from_rank0(sync.broadcast_text(None))
            return self._execute_in(run_dir, configure_logging(None, level=logging.WARNING), finder, before_run)
        try:
            if resume is None:
                run_id = cfg.run.run_id if finder is None else "__".join(
                    x for x in (cfg.run.run_id, "lr_finder") if x)
                run_dir = create_run_dir(cfg.run.output_dir, run_id)
            else:
                run_dir = resume.run_dir
                _keep_previous_config(run_dir, self.plain, resume.step)
        except UserError as exc:
            sync.broadcast_text("error:" + str(exc))  # the other ranks refuse with the same line
            raise
        sync.broadcast_text("path:" + str(run_dir))
        (run_dir / "config.toml").write_text(tomli_w.dumps(self.plain), encoding="utf-8")
        data.set_vram_estimate(rank=cfg.lora.rank, base_dtype=cfg.model.base_dtype,
                               gradient_checkpointing=cfg.model.gradient_checkpointing)
        _write_preflight(run_dir, data)
        return self._execute_in(run_dir, configure_logging(run_dir / "log.jsonl"), finder, before_run)

    def _execute_in(self, run_dir: Path, log_handler: Any, finder: Any, before_run: Callable[[Any], None] | None
                    ) -> RunOutcome:
        from wantrain.cli.logs import close_log_file

        data, resume, sync = self.data, self.resume, self.sync
        for note in resume.warnings if resume is not None else ():
            log.warning("resume_note", note=note)
        control_ref: list[Any] = []
        try:
            with stop_on_signals(control_ref):
                try:
                    trainer = self._assemble(run_dir, control_ref, finder=finder)
                except RunInterrupted as exc:
                    log.warning("run_ended", step=resume.step if resume else 0, status="stopped",
                                reason=f"{exc} before the first step (while preparing the cache)")
                    return RunOutcome("stopped", f"{exc} before the first step", resume.step if resume else 0,
                                      run_dir, ())
                if before_run is not None:
                    before_run(trainer)
                result = trainer.run()
        finally:
            if sync.is_main:
                _write_preflight(run_dir, data)  # again: decoding may have verified (re-bucketed, skipped) clips
            close_log_file(log_handler)
        checkpoint = None
        if trainer.checkpoints is not None:
            from wantrain.core.checkpoint import latest_complete

            best, _ = latest_complete(trainer.checkpoints.directory)
            checkpoint = str(best.path) if best is not None else None
        return RunOutcome(result.status, result.reason, result.steps, run_dir, tuple(result.saved), checkpoint,
                          rank=sync.topology.rank)

    def _assemble(self, run_dir: Path, control_ref: list[Any], *, finder: Any = None) -> Any:
        from wantrain.core.adapter import NullSaver
        from wantrain.core.bus import Bus
        from wantrain.core.checkpoint import remove_stale_temporaries
        from wantrain.core.distributed import rank_seed, rank_view
        from wantrain.core.faults import inject_faults
        from wantrain.core.loop import CheckpointPolicy, LoopSettings, Trainer
        from wantrain.core.state import TrainState
        from wantrain.data import ensure_cache
        from wantrain.observers import build_observers
        from wantrain.observers.event_recorder import EventRecorder, event_log_path
        from wantrain.schedulers import build_scheduler

        cfg, data, adapter, resume, sync = self.cfg, self.data, self.adapter, self.resume, self.sync
        main, rank = sync.is_main, sync.topology.rank
        train_cfg, model = cfg.train, adapter
        if finder is not None:  # the LR finder's run (wantrain.lr_finder_run): its length, every step logged
            from wantrain.lr_finder_run import SweepOrder

            train_cfg = attrs.evolve(cfg.train, max_steps=finder.total_steps, log_every=1, save_every=None)
            model = SweepOrder(adapter, finder.steps_per_expert)
        # Encode what the cache lacks before the first step, then free the VAE and the text encoder: training reads
        # latents and embeddings from the cache only (nothing is loaded when everything is cached already).
        # Under torchrun rank 0 fills the cache first; the others then find every entry in it.
        if not main:
            sync.barrier()
        stats = ensure_cache(data, adapter, remove_orphans=False)
        # caches the validation clips and encodes the sample prompts; a range test neither validates nor samples
        watchers = self._validation_observers(run_dir) if finder is None else []
        if main:
            sync.barrier()
        adapter.release_encoders()
        log.info("cache_ready", latents_hit=stats.latents_hit, latents_encoded=stats.latents_encoded,
                 texts_hit=stats.texts_hit, texts_encoded=stats.texts_encoded, clips_failed=stats.clips_failed)
        optimizer = build_optimizer(cfg, adapter.param_groups(), self.device)
        scheduler = build_scheduler(cfg.lr_scheduler, optimizer, total_steps=cfg.train.max_steps)
        bus = Bus()
        for observer in build_observers(cfg, run_dir, extra=self.extra_observers, hparams=self.plain,
                                        writes_files=main):
            bus.attach(observer)
        if finder is not None:
            finder.attach_to(bus)
        for watcher in watchers:
            if hasattr(watcher, "attach_to"):
                watcher.attach_to(bus)  # it emits MetricsLogged of its own at step 0
            else:
                bus.attach(watcher)
        if cfg.observers.record_events and main:
            EventRecorder(event_log_path(run_dir, cfg.observers.record_compression),
                          keep_through_step=resume.step if resume else 0).attach_to(bus)
        state = TrainState()
        policy = None
        if cfg.checkpoint.enabled and finder is None:
            policy = CheckpointPolicy(
                directory=run_dir / "checkpoints", every=cfg.checkpoint.every, keep_last=cfg.checkpoint.keep_last,
                keep_every=cfg.checkpoint.keep_every,
                meta={"config": _without_faults(self.plain), "config_hash": config_hash(self.plain)},
            )
        trainer = Trainer(
            adapter=inject_faults(model, optimizer, cfg.faults, state, rank),
            batches=data.stream(adapter), optimizer=optimizer, scheduler=scheduler,
            saver=adapter.saver(run_dir, cfg.run.name) if finder is None and main else NullSaver(),
            settings=LoopSettings.from_config(train_cfg), bus=bus, run_dir=run_dir,
            seed=rank_seed(cfg.run.seed, rank), state=state, checkpoints=policy, sync=sync,
        )
        if self.initial_state is not None:
            from wantrain.lr_finder_run import load_initial_state

            load_initial_state(trainer, self.initial_state)
        if resume is not None:
            if main:
                remove_stale_temporaries(run_dir / "checkpoints")
                for leftover in run_dir.glob(".*.safetensors.tmp-*"):  # a LoRA file an interrupted save left unnamed
                    leftover.unlink(missing_ok=True)
                _set_aside_later_checkpoints(run_dir / "checkpoints", resume.step)
            for note in trainer.load_state_dict(rank_view(resume.tree, rank), source=str(resume.checkpoint)):
                log.warning("resume_note", note=note)
            log.info("run_resumed", checkpoint=str(resume.checkpoint), step=resume.step)
        sync.broadcast_parameters(adapter.trainable_parameters())  # every rank starts from rank 0's LoRA
        control_ref.append(trainer.control)
        return trainer


    def _validation_observers(self, run_dir: Path) -> list[Any]:
        """The [validation] and [sample] observers, built while the encoders are still loaded."""
        from wantrain.data import ensure_cache
        from wantrain.models.wan22.variants import variant_spec

        cfg, adapter, out = self.cfg, self.adapter, []
        if self.validation_data is not None:
            from wantrain.observers.validation import Validation, cached_batches

            stats = ensure_cache(self.validation_data, adapter, remove_orphans=False)
            log.info("validation_cache_ready", latents_hit=stats.latents_hit, latents_encoded=stats.latents_encoded)
            v = cfg.validation
            out.append(Validation(cached_batches(self.validation_data, adapter), timesteps=v.timesteps, seed=v.seed,
                                  every=v.every))
        if cfg.sample.enabled:
            from wantrain.observers.samples import build_sample_observer

            out.append(build_sample_observer(cfg, variant_spec(cfg.model.variant), adapter, run_dir))
        return out


def _without_faults(plain: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plain.items() if k != "faults"}


def _write_preflight(run_dir: Path, data: Any) -> None:
    tmp = run_dir / "preflight.json.tmp"
    tmp.write_text(json.dumps(data.report.to_json(), indent=2), encoding="utf-8")
    tmp.replace(run_dir / "preflight.json")


def _keep_previous_config(run_dir: Path, plain: dict[str, Any], step: int) -> None:
    """On resume with a changed config, keep the one the run had as ``config.until_step_NNNNNN.toml``."""
    path = run_dir / "config.toml"
    try:
        with path.open("rb") as fh:
            old = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return
    if old != json.loads(json.dumps(plain, default=str)):
        target = run_dir / f"config.until_step_{step:06d}.toml"
        if not target.exists():
            path.replace(target)


def _set_aside_later_checkpoints(directory: Path, step: int) -> None:
    """Checkpoints newer than the one resumed from belong to an abandoned continuation: rename them out of the
    ``step_*`` namespace (never deleted) so that ``--resume auto`` does not pick them later."""
    from wantrain.core.checkpoint import list_checkpoints

    stamp = time.strftime("%Y%m%d_%H%M%S")
    for c in list_checkpoints(directory):
        if c.complete and c.step > step:
            c.path.replace(c.path.with_name(f"superseded_{c.path.name}_{stamp}"))
            log.warning("checkpoint_set_aside", path=str(c.path), reason=f"resumed from step {step}")


def prepare(cfg: Any, *, config_dir: Path | None = None, resume: str | Path | None = None) -> PreparedRun:
    """Validate everything a run needs, in the order a user pays for it (cheap checks first), writing nothing."""
    from wantrain.config import to_plain
    from wantrain.core.distributed import ProcessGroupSync, SingleProcess, detect_topology
    from wantrain.core.rundir import sanitize_run_id
    from wantrain.data import build_dataset
    from wantrain.models.wan22 import build_adapter
    from wantrain.models.wan22.variants import variant_spec
    from wantrain.observers import resolve_extra_observers
    from wantrain.observers.validation import build_validation_data
    from wantrain.observers.validation_config import check_sections
    from wantrain.optimizers import check_optimizer
    from wantrain.schedulers import check_scheduler

    if cfg.run.run_id is not None:
        sanitize_run_id(cfg.run.run_id)
    if cfg.lr_finder.active:
        from wantrain.lr_finder_run import check_lr_finder

        check_lr_finder(cfg, resume)
    plain = to_plain(cfg)
    check_scheduler(cfg.lr_scheduler, cfg.train.max_steps)  # a warmup longer than the run, ... refused here
    extra_observers = resolve_extra_observers(cfg, config_dir)
    point = load_resume_point(resume, cfg, plain) if resume is not None else None
    topology = detect_topology()
    if point is not None:
        check_resume_world_size(point, topology.world_size)
    if topology.distributed and (cfg.validation.enabled or cfg.sample.enabled):
        raise UserError("[validation] and [sample] do not run under torchrun yet (several processes); set "
                        "validation.enabled = false and sample.enabled = false, or train with one process")
    device = resolve_device(cfg.train.device)
    if topology.distributed and device.type == "cuda":
        device = torch.device("cuda", topology.local_rank)  # one GPU per rank
        torch.cuda.set_device(device)
    check_optimizer(cfg.optimizer, device)  # one trial step: a backend that cannot run on the device refuses here
    spec = variant_spec(cfg.model.variant)
    data = build_dataset(cfg.data, spec=spec, seed=cfg.run.seed, batch_size=cfg.train.batch_size)
    check_sections(cfg.validation, cfg.sample, spec, cfg.model.trained_experts)
    validation_data = build_validation_data(cfg, spec, cfg.run.seed) if cfg.validation.enabled else None
    data.shard(topology.rank, topology.world_size)
    if point is not None:
        saved_data = point.tree.get("data") or {}
        if saved_data.get("fingerprint") not in (None, data.fingerprint()):
            raise UserError(
                f"checkpoint '{point.checkpoint}' was trained on another clip list (files were added, removed or "
                "renamed in the dataset folders since); restore the data or start a new run"
            )
    torch.manual_seed(cfg.run.seed)
    adapter = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=device, base_lr=cfg.optimizer.lr)
    sync = ProcessGroupSync.start(topology, device) if topology.distributed else SingleProcess()
    return PreparedRun(cfg, plain, config_dir, device, data, adapter, extra_observers, point,
                       validation_data=validation_data, sync=sync)


def train(config: Any, *, overrides: Sequence[str] = (), resume: str | Path | None = None,
          config_dir: Path | None = None) -> RunOutcome:
    """Train from a config file path (with ``section.key=value`` overrides) or a loaded ``RunConfig``.

    ``resume``: ``"auto"`` or a run/checkpoint directory. Raises :class:`wantrain.core.errors.UserError` (one line)
    for bad input; returns the outcome otherwise (``outcome.exit_code`` is what ``wantrain run`` exits with).
    """
    from wantrain.config import load_config

    if isinstance(config, str | Path):
        path = Path(config)
        cfg = load_config(path, list(overrides))
        config_dir = config_dir or path.resolve().parent
    else:
        if overrides:
            raise TypeError("overrides apply to a config file; pass a path, or change the RunConfig yourself")
        cfg = config
    prepared = prepare(cfg, config_dir=config_dir, resume=resume)
    try:
        return prepared.execute()
    finally:
        prepared.sync.close()  # torchrun: leave the process group (one process: nothing to do)
