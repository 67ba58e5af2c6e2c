"""The one place that assembles a run from a config: ``wantrain run``, resume, the LR finder's mode
(``wantrain.app.lr_finder``) and torchrun (``core.parallel.distributed``) all go through :func:`prepare` and
:meth:`PreparedRun.execute`; replay builds its observers from the same table (``wantrain.app.observers``). The
assembly has no mode branch: a mode changes it only through :class:`RunOptions`, and it never calls a mode.

Two phases, so that bad input never leaves anything behind:

* :func:`prepare` validates everything that can refuse the config (data folders, the model, observers, the LR
  schedule, the checkpoint to resume from and its compatibility) and writes nothing in a run directory. In one
  process it fills the data cache (the shared one, outside the run directory) and encodes the sample prompts with
  the VAE and text encoder alone, and releases them, before it loads the experts
  (:func:`encode_before_the_experts`): the host never holds the encoders and the experts' copies at once.
* :meth:`PreparedRun.execute` creates (or, on resume, reuses) the run directory, fills the cache (torchrun: rank 0
  first, after the experts loaded), builds the optimizer, scheduler, observers and trainer, restores the
  checkpoint, and trains.

Exit codes (:data:`EXIT_CODES`): 0 completed, 1 failed, 2 bad input, 3 stopped (a signal or an observer's request;
a checkpoint was written and ``--resume auto`` continues), 130 aborted by a second Ctrl-C.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import tomli_w
import torch

from wantrain.app.logs import close_log_file, configure_logging
from wantrain.app.observers import build_observers, write_config_source
from wantrain.app.resume import (
    ResumePoint,
    check_resume_world_size,
    config_hash,
    confirm_resume_point,
    keep_previous_config,
    tidy_for_resume,
)
from wantrain.app.run_plan import RunPlan, check_resume_data, plan_run
from wantrain.app.signals import RunAborted, RunInterrupted, describe_abort, stop_on_signals
from wantrain.core.adapter import NullSaver, check_needs
from wantrain.core.atomic import atomic_write, critical_section, is_storage_error, storage_error
from wantrain.core.bus import Bus
from wantrain.core.checkpoint import latest_complete, step_dir_name
from wantrain.core.errors import UserError
from wantrain.core.events import RunStarted
from wantrain.core.events.log import event_log_path
from wantrain.core.faults import inject_faults
from wantrain.core.loop import CheckpointPolicy, LoopSettings, Trainer
from wantrain.core.parallel.distributed import (
    ProcessGroupSync,
    SingleProcess,
    detect_topology,
    init_default_group,
    rank_view,
)
from wantrain.core.parallel.expert_groups import ExpertGroupSync, GroupSaver
from wantrain.core.parallel.expert_relay import RelayedExpert
from wantrain.core.rundir import RunDirLock, create_run_dir, lock_run_dir, refuse_links
from wantrain.core.state import TrainState
from wantrain.core.state_check import check_state_tree
from wantrain.data import ensure_cache
from wantrain.data.cache import CacheStats
from wantrain.data.fingerprints import DataChanged, file_fingerprints
from wantrain.data.media import decode_video
from wantrain.models.wan22 import build_adapter, build_encoders
from wantrain.models.wan22.adapter import FP8_DEVICE_TYPES
from wantrain.models.wan22.attention import kernel_in_use
from wantrain.models.wan22.compile import use_cache_dir
from wantrain.models.wan22.config import FP8_DTYPES
from wantrain.models.wan22.sequence import split_sequences
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.evaluation.sample_setup import build_sample_observer
from wantrain.observers.evaluation.validation import Validation, cached_batches, evaluation_share
from wantrain.observers.evaluation.workflow import ComfyWorkflow, workflow_settings
from wantrain.observers.event_recorder import EventRecorder
from wantrain.optimizers import build_optimizer as _build_optimizer
from wantrain.schedulers import build_scheduler

log = structlog.get_logger("wantrain.run")

EXIT_CODES = {"completed": 0, "failed": 1, "stopped": 3}
"""Process exit code of ``wantrain run`` per run status (bad input is 2, an abort 130)."""

def _run_dir_from_rank0(message: str) -> Path:
    kind, _, text = message.partition(":")
    if kind == "error":
        raise UserError(text)
    return Path(text)


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


def build_optimizer(cfg: Any, param_groups: list[dict[str, Any]], device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer over the adapter's groups (``wantrain.optimizers``; fused AdamW by default)."""
    return _build_optimizer(cfg.optimizer, param_groups, device)


@attrs.frozen
class RunOptions:
    """How a mode runs the assembly, in plain terms (the default: a normal training run). The LR finder's range
    test (``wantrain.app.lr_finder``) is the user of every one of them."""

    run_id_suffix: str | None = None  # the run directory is <time>__<run_id>__<suffix> (fresh runs)
    loop: Any = None  # a TrainConfig whose loop settings (length, log and save interval) replace cfg.train's
    model_view: Callable[[Any], Any] | None = None  # wraps the adapter as the loop sees it (e.g. another order)
    observers: Sequence[Any] = ()  # attached after the built-in ones (an observer, or anything with attach_to)
    saves: bool = True  # False: no LoRA files and no checkpoints
    evaluation: bool = True  # False: no [validation] and no [sample] observers
    without: Sequence[str] = ()  # built-in observers left out, by name (wantrain.app.observers.BUILT_IN)
    before_run: Callable[[Any], None] | None = None  # called with the trainer right before its first step


@attrs.frozen
class EncodedFirst:
    """What the encoders made before the experts loaded (:func:`encode_before_the_experts`)."""

    stats: CacheStats  # the training cache
    validation_stats: CacheStats | None  # the [validation] clips' ([validation] off: None)
    prompts: dict[str, torch.Tensor]  # [sample]'s prompts and negative prompts: text embeddings on the CPU, by text


def encode_before_the_experts(cfg: Any, model: Any, data: Any, validation_data: Any, device: torch.device,
                              extra_observers: Sequence[type] = ()) -> EncodedFirst:
    """Fill the cache of the training and the [validation] clips and encode [sample]'s prompts with the VAE and the
    text encoder alone (``build_encoders``: no transformer; ``model`` is the planned ``[model]`` section, whose
    dtype the text embeddings are keyed on), then release them (``release_encoders``: dropped and collected, no
    reference kept): what the host holds while the cache fills is the encoders alone, never the experts' copies
    too (docs/models.md, Host memory). Nothing loads when every entry is cached and [sample] is off. A signal
    meanwhile raises :class:`RunInterrupted` (``wantrain.app.signals``); the global RNG is left as it was found.
    ``extra_observers`` lacking a capability of the adapter are refused first (the encoders-only adapter is of the
    same class), before any cache entry is written (the model files were checked by the pre-flight,
    ``app.run_plan``)."""
    encoders = build_encoders(model, cfg.lora, seed=cfg.run.seed, device=device)
    for observer_class in extra_observers:
        check_needs(observer_class.__name__, encoders, needs=getattr(observer_class, "needs", ()))
    try:
        with torch.random.fork_rng(devices=[]), stop_on_signals([]):
            stats = ensure_cache(data, encoders, remove_orphans=False)
            validation = (ensure_cache(validation_data, encoders, remove_orphans=False)
                          if validation_data is not None else None)
            prompts: dict[str, torch.Tensor] = {}
            for p in cfg.sample.resolved(variant_spec(cfg.model.variant)) if cfg.sample.enabled else ():
                for text in (p.prompt, p.negative_prompt if p.guided else None):
                    if text is not None and text not in prompts:
                        prompts[text] = encoders.encode_text([text])["text_embeds"].cpu()
    finally:
        encoders.release_encoders()
    return EncodedFirst(stats, validation, prompts)


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
    validation_data: Any = None  # the [validation] clips (build_validation_data)
    sync: Any = attrs.field(factory=SingleProcess)  # core.parallel.distributed: SingleProcess or ProcessGroupSync
    data_changes: tuple[str, ...] = ()  # media changed since the resumed checkpoint (--allow-data-changes)
    lock: RunDirLock | None = None  # the run directory's lock (a resume takes it in prepare(), a fresh run in execute)
    encoded: EncodedFirst | None = None  # one process: the cache filled before the experts loaded (prepare())
    config_file: Path | None = None  # the config file the run was given (recorded for --resume auto)

    def execute(self, options: RunOptions = RunOptions()) -> RunOutcome:
        """Train (see the module docstring) as ``options`` say. The run directory is locked (``core.rundir``)
        before anything is written in it, and released when the run ends."""
        control_ref: list[Any] = []
        try:
            with stop_on_signals(control_ref):
                interrupted = None
                try:
                    with critical_section():  # a signal while the run directory is set up lands once it is
                        run_dir, log_handler = self._set_up_run_dir(options)
                except RunInterrupted as exc:
                    interrupted = exc
                return self._execute_in(run_dir, log_handler, options, control_ref, interrupted)
        finally:
            self.release()

    def release(self) -> None:
        """Give up the run directory's lock (the end of :meth:`execute` does; so does the process's end)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _set_up_run_dir(self, options: RunOptions) -> tuple[Path, Any]:
        """Create (or, on resume, reuse) and lock the run directory, write the config, its source and the
        preflight report: each file atomically (``core.atomic``), the config kept before it is replaced."""
        cfg, resume, sync = self.cfg, self.resume, self.sync
        if not sync.is_main:  # rank 0 alone creates the run directory and writes its files; the others learn it
            run_dir = _run_dir_from_rank0(sync.broadcast_text(None))
            return run_dir, configure_logging(None, level=logging.WARNING)
        try:
            if resume is None:
                run_id = "__".join(x for x in (cfg.run.run_id, options.run_id_suffix) if x) or None
                run_dir = create_run_dir(cfg.run.output_dir, run_id)
                self.lock = lock_run_dir(run_dir)
            else:
                run_dir = resume.run_dir
                if self.lock is None or self.lock.run_dir != run_dir:
                    self.release()
                    self.lock = lock_run_dir(run_dir)
                keep_previous_config(run_dir, self.plain, resume.step)
        except UserError as exc:
            sync.broadcast_text("error:" + str(exc))  # the other ranks refuse with the same line
            raise
        sync.broadcast_text("path:" + str(run_dir))
        atomic_write(run_dir / "config.toml", tomli_w.dumps(self.plain), what="run file")
        write_config_source(run_dir, self.config_dir, self.config_file)
        _write_preflight(run_dir, self.data)
        return run_dir, configure_logging(run_dir / "log.jsonl")

    def _execute_in(self, run_dir: Path, log_handler: Any, options: RunOptions, control_ref: list[Any],
                    interrupted: RunInterrupted | None) -> RunOutcome:
        data, resume, sync = self.data, self.resume, self.sync
        for note in resume.warnings if resume is not None else ():
            log.warning("resume_note", note=note)
        for loaded in getattr(self.adapter, "loaded_files", ()):  # lora.init_from*: format, type, rank, alpha
            log.info("lora_init_loaded", **loaded)
        for note in data.report.warnings if sync.is_main else ():
            log.warning("config_warning", note=note)
        if data.report.speed and sync.is_main:
            speed = data.report.speed
            ran = kernel_in_use(self.adapter.transformer_for(self.adapter.experts[0]))
            log.info("speed", attention=speed["attention"], attention_backend=ran,
                     compile=speed["compile"]["mode"], compile_dynamic=speed["compile"]["dynamic"],
                     compile_cache=speed["compile"]["cache_dir"])
        trainer = None
        try:
            try:
                if interrupted is not None:
                    raise interrupted
                trainer = self._assemble(run_dir, control_ref, options)
            except RunInterrupted as exc:
                log.warning("run_ended", step=resume.step if resume else 0, status="stopped",
                            reason=f"{exc} before the first step (while preparing the cache)")
                return RunOutcome("stopped", f"{exc} before the first step", resume.step if resume else 0,
                                  run_dir, ())
            if options.before_run is not None:
                options.before_run(trainer)
            try:
                result = trainer.run()
            except KeyboardInterrupt:
                raise RunAborted(describe_abort(trainer, run_dir)) from None
        finally:
            if sync.is_main:  # again: decoding may have verified (re-bucketed, skipped) clips
                _cleanup(lambda: _write_preflight(run_dir, data), "preflight_not_rewritten")
            _cleanup(lambda: close_log_file(log_handler), "log_not_closed")
        checkpoint = None
        if trainer.checkpoints is not None:
            best, _ = latest_complete(trainer.checkpoints.directory)
            checkpoint = str(best.path) if best is not None else None
        return RunOutcome(result.status, result.reason, result.steps, run_dir, tuple(result.saved), checkpoint,
                          rank=sync.topology.rank)

    def _assemble(self, run_dir: Path, control_ref: list[Any], options: RunOptions) -> Any:
        cfg, data, adapter, resume, sync = self.cfg, self.data, self.adapter, self.resume, self.sync
        main, rank = sync.is_main, sync.topology.rank
        train_cfg = options.loop if options.loop is not None else cfg.train
        model = options.model_view(adapter) if options.model_view is not None else adapter
        # Encode what the cache lacks before the first step, then free the VAE and the text encoder: training reads
        # latents and embeddings from the cache only (nothing is loaded when everything is cached already). One
        # process did so in prepare(), before the experts loaded (self.encoded). Under torchrun rank 0 fills the
        # cache here first; the others then find every entry in it. They wait on a barrier without the collective
        # timeout: encoding a large uncached dataset can take hours.
        if not main:
            sync.wait_for_rank0()
        stats = self.encoded.stats if self.encoded is not None else ensure_cache(data, adapter, remove_orphans=False)
        # caches the validation clips and encodes the sample prompts while the encoders are loaded
        watchers = self._validation_observers(run_dir) if options.evaluation else []
        if main:
            sync.wait_for_rank0()
        adapter.release_encoders()
        log.info("cache_ready", latents_hit=stats.latents_hit, latents_encoded=stats.latents_encoded,
                 texts_hit=stats.texts_hit, texts_encoded=stats.texts_encoded, clips_failed=stats.clips_failed)
        optimizer = build_optimizer(cfg, adapter.param_groups(), self.device)
        scheduler = build_scheduler(cfg.lr_scheduler, optimizer, total_steps=cfg.train.max_steps)
        bus = Bus()
        for observer in build_observers(cfg, run_dir, extra=self.extra_observers, hparams=self.plain,
                                        writes_files=main, without=options.without,
                                        experts=run_experts(sync, adapter)):
            bus.attach(observer)
        if options.saves and main and hasattr(adapter, "sampling_scheduler"):  # a ComfyUI graph beside each save
            bus.attach(ComfyWorkflow(workflow_settings(cfg, variant_spec(cfg.model.variant),
                                                       adapter.sampling_scheduler()), run_experts(sync, adapter)))
        for observer in [*options.observers, *watchers]:
            if hasattr(observer, "attach_to"):
                observer.attach_to(bus)  # it emits events of its own (the finder; validation at step 0)
            else:
                bus.attach(observer)
        if cfg.observers.record_events and main:
            EventRecorder(event_log_path(run_dir, cfg.observers.record_compression),
                          keep_through_step=resume.step if resume else 0).attach_to(bus)
        if self.data_changes and resume is not None:  # on record, right after RunStarted
            changed = DataChanged(step=resume.step, changed=self.data_changes, checkpoint=str(resume.checkpoint))
            bus.subscribe(RunStarted, lambda _event, _ctx: bus.emit(changed), name="data_changes")
        state = TrainState()
        policy = None
        if cfg.checkpoint.enabled and options.saves:
            policy = CheckpointPolicy(
                directory=run_dir / "checkpoints", every=cfg.checkpoint.every, keep_last=cfg.checkpoint.keep_last,
                keep_every=cfg.checkpoint.keep_every,
                meta={"config": _without_faults(self.plain), "config_hash": config_hash(self.plain),
                      "data_files": file_fingerprints(data.clips)},
            )
        sync.watch_checkpoints(policy.directory if policy is not None else None)  # a failure's resume hint
        trainer = Trainer(
            adapter=inject_faults(model, optimizer, cfg.faults, state, rank, checkpoints=policy),
            batches=data.stream(adapter, pin_memory=self.device.type == "cuda"), optimizer=optimizer,
            scheduler=scheduler,
            saver=self._saver(run_dir) if options.saves else NullSaver(),
            settings=LoopSettings.from_config(train_cfg), bus=bus, run_dir=run_dir,
            seed=cfg.run.seed, state=state, checkpoints=policy, sync=sync,
        )
        if resume is not None:
            source = resume.checkpoint
            if main:
                tidy_for_resume(run_dir, resume.step)
                if not source.exists():  # read under its rotation name (a kill mid-save), now back under step_*
                    source = source.parent / step_dir_name(resume.step)
            notes = trainer.load_state_dict(rank_view(resume.tree, rank), source=str(source),
                                            meta=resume.meta if main else None)
            for note in notes:
                log.warning("resume_note", note=note)
            log.info("run_resumed", checkpoint=str(resume.checkpoint), step=resume.step)
        sync.broadcast_parameters(adapter.trainable_parameters())  # every rank starts from rank 0's LoRA
        control_ref.append(trainer.control)
        return trainer

    def _saver(self, run_dir: Path) -> Any:
        """The LoRA files' writer: rank 0's (the other ranks write nothing); with expert groups every rank's
        ``GroupSaver``, through which the group leaders' files reach rank 0 (``core.parallel.expert_groups``); sharded
        (fsdp), every rank's saver: each sends its rows of the LoRA to rank 0, which alone gathers and writes."""
        sync = self.sync
        if isinstance(sync, ExpertGroupSync):  # sharded: every rank of a group gathers, its leader keeps the files
            saver = self.adapter.saver(run_dir, self.cfg.run.name, writes=sync.groups.is_leader)
            return GroupSaver(sync, saver.files, saver.write if sync.is_main else None)
        if sync.sharded:  # fsdp: every rank takes part in gathering the LoRA to rank 0, which writes
            return self.adapter.saver(run_dir, self.cfg.run.name, writes=sync.is_main)
        saver = self.adapter.saver(run_dir, self.cfg.run.name)
        return saver if sync.is_main else NullSaver()

    def _validation_observers(self, run_dir: Path) -> list[Any]:
        """The [validation] and [sample] observers, built while the encoders are still loaded."""
        cfg, adapter, out = self.cfg, self.adapter, []
        encoded = self.encoded
        if self.validation_data is not None:
            stats = (encoded.validation_stats if encoded is not None and encoded.validation_stats is not None
                     else ensure_cache(self.validation_data, adapter, remove_orphans=False))
            log.info("validation_cache_ready", latents_hit=stats.latents_hit, latents_encoded=stats.latents_encoded)
            v = cfg.validation
            topology = self.sync.topology  # under torchrun each data-parallel place evaluates its share of clips
            batches = cached_batches(self.validation_data, adapter)
            sequence = cfg.model.sequence_degree  # the ranks of a sequence group evaluate the same clips
            place, ranks = ((self.sync.groups.rank_in_group, self.sync.groups.size)  # expert groups: its group's
                            if isinstance(self.sync, ExpertGroupSync) else
                            (topology.rank // sequence, topology.world_size // sequence))
            exchanges = topology.distributed and self.sync.forward_exchanges
            share, padding = evaluation_share(len(batches), place, ranks, in_step=exchanges)
            out.append(Validation([batches[c] for c in share], timesteps=v.timesteps, seed=v.seed, every=v.every,
                                  sync=self.sync if topology.distributed else None, clip_indices=share,
                                  clips_total=len(batches), run_experts=run_experts(self.sync, adapter),
                                  padding=[batches[0]] * padding))
        if cfg.sample.enabled:
            out.append(build_sample_observer(cfg, variant_spec(cfg.model.variant), adapter, run_dir, sync=self.sync,
                                             clips=self._first_frame_sources(), clip_videos=self._clip_videos,
                                             prompt_embeds=encoded.prompts if encoded is not None else None))
        return out

    def _clip_videos(self, width: int, height: int) -> Iterator[np.ndarray]:
        """The training clips' frames at a sample's size, for the motion ratio (:func:`_clip_frames`)."""
        return _clip_frames(self.data, width, height)

    def _first_frame_sources(self) -> list[tuple[Any, int, str]]:
        """Where an I2V prompt without an image takes its first frame: the validation clips in order, else the
        first training clip (as (data, clip index, what it is) triples)."""
        if self.validation_data is not None and self.validation_data.clips:
            return [(self.validation_data, i, "validation clip") for i in range(len(self.validation_data.clips))]
        return [(self.data, 0, "training clip")] if self.data.clips else []


MOTION_CLIPS = 8
"""At most this many training video clips are measured for ``samples/motion_ratio`` (the first ones)."""


def _clip_frames(data: Any, width: int, height: int) -> Iterator[np.ndarray]:
    """The training frames of ``data``'s first :data:`MOTION_CLIPS` video clips, resized and cropped to
    ``width`` x ``height`` like training pixels (uint8 ``[F, H, W, 3]``); a clip that cannot be decoded is left out."""
    for clip in [c for c in data.clips if c.kind == "video"][:MOTION_CLIPS]:
        decoded = decode_video(clip.path, clip.source_indices(), width, height, clip.rotation)
        if decoded.frames is not None and len(decoded.frames) > 1:
            yield decoded.frames


def run_experts(sync: Any, adapter: Any) -> tuple[str | None, ...]:
    """The experts the run trains: this rank's adapter's, or with expert groups every group's, in group order."""
    return sync.experts if isinstance(sync, ExpertGroupSync) else tuple(adapter.experts)


def _without_faults(plain: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plain.items() if k != "faults"}


def _write_preflight(run_dir: Path, data: Any) -> None:
    atomic_write(run_dir / "preflight.json", json.dumps(data.report.to_json(), indent=2), what="run file")


def _cleanup(step: Callable[[], None], event: str) -> None:
    """A step of a run's ending that must not raise again while the run's own error (a full disk) propagates: a
    storage error there is one warning line; anything else is a bug and keeps its traceback."""
    try:
        step()
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        log.warning(event, error=str(storage_error("run file", getattr(exc, "path", None) or "", exc)))


def _run_check(adapter: Any, rank: int) -> Callable[[Any], str | None]:
    """The resume check against the built model: its LoRA tensors and the optimizer's parameter groups."""
    model = adapter.state_dict() if callable(getattr(adapter, "state_dict", None)) else None
    groups = [list(g["params"]) for g in adapter.param_groups()]
    return lambda tree: check_state_tree(rank_view(tree, rank), model=model, param_groups=groups)


def prepare(cfg: Any, *, config_dir: Path | None = None, resume: str | Path | None = None,
            allow_data_changes: bool = False, config_file: Path | None = None) -> PreparedRun:
    """Validate everything a run needs, writing nothing, then load it. The pre-flight (``app.run_plan.plan_run``,
    one call) judges the config, the launch, the data, the checkpoint to resume and the model files, in the order
    a user pays for them (cheap first); then the encoders fill the cache and the model loads as it planned.
    ``allow_data_changes``: resume on media whose content or caption changed since the checkpoint.
    ``config_file``: the file ``cfg`` was loaded from (recorded in the run directory; ``--resume auto`` continues
    only a run of the same file).
    """
    topology = detect_topology()
    plan = plan_run(cfg, topology, config_dir=config_dir, resume=resume, allow_data_changes=allow_data_changes,
                    config_file=config_file)
    try:
        prepared = _load(plan, config_dir, topology, allow_data_changes)
        return attrs.evolve(prepared, config_file=config_file)
    except BaseException:
        plan.release()
        raise


def _load(plan: RunPlan, config_dir: Path | None, topology: Any, allow_data_changes: bool) -> PreparedRun:
    """What :func:`prepare` loads once the plan holds: the cache (one process: the encoders first, released
    before the experts load; torchrun: in execute(), rank 0 first), the adapter, the resumed checkpoint's tensors
    against it, the ranks' syncs and the layouts applied to the experts."""
    cfg, data, device, groups, point, held = plan.cfg, plan.data, plan.device, plan.groups, plan.point, plan.held
    spec = variant_spec(cfg.model.variant)
    torch.manual_seed(cfg.run.seed)
    if plan.compile_cache is not None:
        use_cache_dir(plan.compile_cache)
    # A model the adapter will not build on this device (fp8 on a CPU) is refused by build_adapter first, before
    # any cache entry is written.
    refused = plan.model.base_dtype in FP8_DTYPES and device.type not in FP8_DEVICE_TYPES
    encoded = None if topology.distributed or refused else encode_before_the_experts(
        cfg, plan.model, data, plan.validation_data, device, plan.extra_observers)
    sharded = cfg.model.parallel == "fsdp" and topology.distributed
    # sharded: the weights are read by one rank (rank 0, or with expert groups each group's leader), on meta elsewhere
    source = groups.is_leader if groups is not None else topology.is_main
    adapter = build_adapter(plan.model, cfg.lora, seed=cfg.run.seed, device=device, base_lr=cfg.optimizer.lr,
                            shard_load=("rank0" if source else "meta") if sharded else None,
                            waiting_folder=plan.waiting_folder)
    for observer_class in plan.extra_observers:  # a capability the model lacks: refused before the run dir exists
        check_needs(observer_class.__name__, adapter, needs=getattr(observer_class, "needs", ()))
    data_changes = plan.data_changes
    if point is not None:  # the tensors against the model: one that does not fit is damage (auto: an older one)
        confirmed = confirm_resume_point(point, plan.plain, _run_check(adapter, topology.rank))
        if confirmed is not point:
            point = confirmed
            refuse_links(point.run_dir)
            if held and held[-1].run_dir != point.run_dir:  # an older run's checkpoint: lock that run instead
                held[-1].release()
                held.append(lock_run_dir(point.run_dir))
            data_changes = check_resume_data(point, data, allow_data_changes)
    if point is not None:
        regrouped = check_resume_world_size(point, topology.world_size, expert_groups=groups.count if groups else 1,
                                            sharded=cfg.model.parallel == "fsdp" and groups is None)
        data.report.warnings.extend([regrouped] if regrouped else [])
    if cfg.lora.starts_from_files:  # lora.init_from*: rank and alpha as read from the files
        cfg = attrs.evolve(cfg, lora=attrs.evolve(cfg.lora, rank=adapter.lora_config.rank,
                                                  alpha=adapter.lora_config.alpha))
    if cfg.sample.enabled and topology.is_main and groups is None:  # one trained expert: the other one's weights
        adapter.add_sampling_expert(cfg.sample.other_expert_lora)
    if sharded and cfg.model.blocks_to_swap and topology.distributed:  # FSDP2 keeps those blocks' shards on the host
        init_default_group(topology, device, host_collectives=True)
    if groups is not None:
        sync = ExpertGroupSync.start(topology, device, groups=groups, experts=spec.experts)
    else:
        sync = ProcessGroupSync.start(topology, device) if topology.distributed else SingleProcess()
    if cfg.sample.enabled and groups is not None and topology.is_main:  # the other group's expert: relayed there
        for expert, relay in sync.relays().items():
            adapter.add_relayed_expert(expert, RelayedExpert(relay))
    sequence = cfg.model.sequence_degree
    if sequence > 1:  # Ulysses: each rank of a sequence group holds 1/sequence of every clip's tokens
        split_sequences(adapter, device, topology.world_size, sequence)
        sync.split_sequences(sequence)
    if sharded:
        shard_experts(adapter, device, topology.world_size, cfg.model.shard_degree, sequence,
                      sync if groups is not None else None, blocks_to_swap=cfg.model.blocks_to_swap,
                      pin=cfg.model.pin_host_copies)
        sync.shard()
    return PreparedRun(cfg, plan.plain, config_dir, device, data, adapter, plan.extra_observers, point,
                       validation_data=plan.validation_data, sync=sync, data_changes=data_changes,
                       lock=held[-1] if held else None, encoded=encoded)


def shard_experts(adapter: Any, device: torch.device, world_size: int, shard_degree: int | None,
                  sequence_degree: int = 1, groups: ExpertGroupSync | None = None, *, blocks_to_swap: int = 0,
                  pin: bool = True) -> None:
    """model.parallel = "fsdp" under torchrun: ``fully_shard`` every block of each trained expert, then the
    expert's root (``core.parallel.sharding.shard_per_block``), on the mesh of ``shard_degree`` ranks per copy (HSDP
    across the groups). After the LoRA is injected and before the optimizer is built: it is built over the ``DTensor``
    parameters that replace the originals. The transformers were built on ``meta`` (``build_adapter(shard_load=)``):
    each rank then allocates its shards only and fills them from rank 0's host copy, which is dropped after
    (``core.parallel.sharding.load_from_rank0``). With ``sequence_degree`` > 1 (Ulysses already on the experts:
    :func:`split_sequences`) the sequence groups are folded into the shard mesh and FSDP2's gradient sum over every
    rank is divided by the data-parallel size, as ``ProcessGroupSync.split_sequences`` divides its all-reduce.

    With expert groups (``groups``, the run's sync; refused with a sequence degree): each group shards its own expert
    over its own ranks (``core.parallel.sharding.group_shard_mesh``; ``shard_degree`` of them per copy, unset: the whole
    group) and fills it from the group leader's host copy over the group only
    (``core.parallel.sharding.load_from_leader``): the groups load side by side.

    ``blocks_to_swap`` (block swap under fsdp): the shards of the last N blocks in run order -- the blocks one-GPU
    block swap takes (``models.wan22.swap.swapped_blocks``) -- live on the host (FSDP2's CPU offload: their LoRA
    steps there too) and cross to the device for each forward and backward; ``pin``: pinned host shards (CUDA
    only)."""
    from wantrain.core.parallel import sharding
    from wantrain.models.wan22.swap import swapped_blocks  # every block, a VACE expert's VACE blocks too

    if groups is None:
        mesh = sharding.shard_mesh(device.type, world_size, shard_degree)
    else:
        mesh = sharding.group_shard_mesh(device.type, world_size, groups.groups.count, shard_degree)
    divide = world_size / sequence_degree if sequence_degree > 1 else None
    for expert in adapter.experts:
        transformer = adapter.transformer_for(expert)
        blocks, held = swapped_blocks(transformer, blocks_to_swap)
        sharding.shard_per_block(transformer, blocks, mesh=mesh, gradient_divide_factor=divide,
                                 param_dtype=sharding.compute_dtype(transformer), reduce_dtype=torch.float32,
                                 on_host=[blocks[k] for k in held], pin=pin and device.type == "cuda")
        source = adapter.host_sources.pop(expert, None)
        if groups is None:
            sharding.load_from_rank0(transformer, source, device)
        else:
            sharding.load_from_leader(transformer, source, device, mesh, group=groups.group_process_group)
