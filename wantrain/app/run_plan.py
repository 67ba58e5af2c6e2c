"""The pre-flight of ``wantrain run``, in one call: :func:`plan_run` judges everything that can refuse a run before
anything is loaded or written, and returns what the assembly (``app.assemble.prepare``) loads and trains with.

In the order a user pays for it, cheap first:

1. the config's problems on this launch, every one at once (``app.preflight.problems``: each capability's rules);
2. the users' observers and W&B, then on ``--resume`` the checkpoint (its schema, the world size, the lock);
3. the device, one trial step of the optimizer on it, this rank's expert group;
4. the data (probed, not decoded) and [validation] / [sample]'s files, each bucket against the sequence degree, the
   epoch keys as optimizer steps, the warnings the run logs; on ``--resume`` the data against the checkpoint's;
5. the attention kernel and the compile (``app.device_plan.speed_plan``), the memory plan for the largest bucket
   (``app.memory_plan.plan_memory``) and the model files it will load.

Nothing here loads a model or writes in a run directory (the data cache is filled by the assembly, after). A
resume's run directory is locked here (:attr:`RunPlan.held`): :meth:`RunPlan.release` gives it up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from wantrain.app.config import to_plain
from wantrain.app.device_plan import compile_cache_dir, resolve_device, speed_plan, waiting_experts_dir
from wantrain.app.epochs import resolve_epochs, uses_epochs
from wantrain.app.launch import parallel_notes, sequence_bucket_problems
from wantrain.app.memory_plan import plan_memory
from wantrain.app.notes import config_warnings, data_warnings
from wantrain.app.observers import require_wandb, resolve_extra_observers
from wantrain.app.preflight import problems
from wantrain.app.resume import ResumePoint, check_resume_world_size, load_resume_point
from wantrain.core.errors import UserError
from wantrain.core.parallel.distributed import rank_view
from wantrain.core.parallel.expert_groups import expert_groups_of
from wantrain.core.problems import Machine, refuse
from wantrain.core.rundir import RunDirLock, lock_run_dir, refuse_links, sanitize_run_id
from wantrain.core.state_check import check_state_tree
from wantrain.data import build_dataset
from wantrain.data.fingerprints import caption_files, file_fingerprints, name_some
from wantrain.data.fingerprints import compare as compare_data
from wantrain.data.training import TrainingData
from wantrain.models.wan22 import check_model_files
from wantrain.models.wan22.placement import expert_group_config
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.evaluation.config import section_file_problems
from wantrain.optimizers import check_optimizer
from wantrain.schedulers import check_scheduler

log = structlog.get_logger("wantrain.run")


@attrs.define
class RunPlan:
    """What the pre-flight of a run found: everything the assembly needs before it loads the model."""

    cfg: Any  # as the run trains it: this rank's expert group's view, the epoch keys as optimizer steps
    plain: dict[str, Any]  # the config as given, plain (written to the run directory, compared on resume)
    device: torch.device  # this rank's
    data: Any  # the training data, probed and sharded for this rank; its report holds the plans and the warnings
    validation_data: TrainingData | None  # the [validation] clips ([validation] off: None)
    model: Any  # the [model] section as the memory plan chose it (block swap, offload, dtype)
    groups: Any  # core.parallel.expert_groups.ExpertGroups, or None without model.expert_groups
    extra_observers: list[type]  # the users' observer classes ([observers] extra)
    point: ResumePoint | None = None  # --resume: the checkpoint, its schema checked (its tensors: after loading)
    held: list[RunDirLock] = attrs.field(factory=list)  # the resumed run directory's lock (rank 0)
    data_changes: tuple[str, ...] = ()  # media changed since the resumed checkpoint (--allow-data-changes)
    compile_cache: Path | None = None  # torch_compile/ in the data's cache (model.compile on)
    waiting_folder: Path | None = None  # waiting_experts/ in the data's cache (model.waiting_expert = "disk")

    def release(self) -> None:
        """Give up the locks the plan holds (a prepare that fails after the plan)."""
        for lock in self.held:
            lock.release()


def plan_run(cfg: Any, topology: Any, *, config_dir: Path | None = None, resume: str | Path | None = None,
             allow_data_changes: bool = False, config_file: Path | None = None) -> RunPlan:
    """The run's pre-flight (see the module docstring), on ``topology`` (``core.parallel.distributed``): every
    refusal that depends on the config, the machine, the data, the checkpoint to resume and the model files, with
    its one line (several config problems: all of them, ``core.problems.Refused``), before anything is loaded or
    written. ``resume``, ``allow_data_changes``, ``config_file``: as ``app.assemble.prepare`` takes them."""
    if cfg.run.run_id is not None:
        sanitize_run_id(cfg.run.run_id)
    plain = to_plain(cfg)
    machine = Machine.here(world_size=topology.world_size, resuming=resume is not None)
    # the config's rules and [validation] / [sample]'s files, every problem at once
    spec = variant_spec(cfg.model.variant)
    refuse([*problems(cfg, machine),
            *section_file_problems(cfg.validation, cfg.sample, spec, cfg.model.trained_experts)])
    extra_observers = resolve_extra_observers(cfg, config_dir)
    if cfg.observers.wandb:
        require_wandb()
    point, held = None, []
    if resume is not None:
        point = load_resume_point(resume, cfg, plain, config_file=config_file,
                                  expect=lambda tree: check_state_tree(rank_view(tree, topology.rank)))
        refuse_links(point.run_dir)  # a resume appends there: never through a link to elsewhere
        # fsdp resumes on another number of ranks; inside expert groups it does not (each rank's group, its
        # leader's state and its data shard follow from the world size)
        check_resume_world_size(point, topology.world_size, expert_groups=cfg.model.expert_groups,
                                sharded=cfg.model.parallel == "fsdp" and cfg.model.expert_groups <= 1)
        if topology.is_main:  # refused here, before the model loads, when another process writes the run
            held.append(lock_run_dir(point.run_dir))
    try:
        return _plan_on_data(cfg, plain, topology, extra_observers, point, held, allow_data_changes)
    except BaseException:
        for lock in held:
            lock.release()
        raise


def _plan_on_data(cfg: Any, plain: dict[str, Any], topology: Any, extra_observers: list[type],
                  point: ResumePoint | None, held: list[RunDirLock], allow_data_changes: bool) -> RunPlan:
    notes = parallel_notes(cfg, topology.world_size)
    device = resolve_device(cfg.train.device)
    if topology.distributed and device.type == "cuda":
        device = torch.device("cuda", topology.local_rank)  # one GPU per rank
        torch.cuda.set_device(device)
    check_optimizer(cfg.optimizer, device)  # one trial step: a backend that cannot run on the device refuses here
    spec = variant_spec(cfg.model.variant)
    groups = expert_groups_of(cfg.model.expert_groups, topology)  # a launch that cannot split: refused here
    if groups is not None:  # this rank trains its group's expert alone, as a one-expert run of it would
        model_cfg, lora_cfg = expert_group_config(cfg.model, cfg.lora, groups.group)
        cfg = attrs.evolve(cfg, model=model_cfg, lora=lora_cfg)
    data = build_dataset(cfg.data, spec=spec, seed=cfg.run.seed, batch_size=cfg.train.batch_size)
    validation_data = build_validation_data(cfg, spec, cfg.run.seed) if cfg.validation.enabled else None
    # the data-parallel rank: its place in its expert group, or its sequence group's (whose ranks share samples)
    sequence = cfg.model.sequence_degree
    data.shard(*((groups.rank_in_group, groups.size) if groups else
                 (topology.rank // sequence, topology.world_size // sequence)))
    # a bucket whose tokens (with a clip's reference image) do not split over the sequence degree
    refuse(sequence_bucket_problems(cfg, data.report.buckets, getattr(data, "clips", ())))
    given = cfg
    if uses_epochs(cfg):
        cfg = resolve_epochs(cfg, data)  # epochs -> optimizer steps of this plan; `plain` keeps the user's keys
        check_scheduler(cfg.lr_scheduler, cfg.train.max_steps)
    # logged once the run's log exists (config_warning)
    data.report.warnings.extend([*config_warnings(cfg, given), *notes, *data_warnings(data)])
    data_changes: tuple[str, ...] = ()
    if point is not None:
        if cfg.train.max_steps < point.step:  # it would report "completed" at more than 100 %
            raise UserError(f"train.max_steps = {cfg.train.max_steps} is below the step of checkpoint "
                            f"'{point.checkpoint}' ({point.step}): the run is already past it; resume with "
                            f"--max-steps {point.step + 1} or more to train on (its LoRA files are in the run "
                            "directory)")
        data_changes = check_resume_data(point, data, allow_data_changes)
    speed_plan(cfg, data, device)  # the kernel and the compile on this device, into the report
    model = plan_memory(cfg, data)  # a budget nothing fits is refused here, before the adapter loads
    if not topology.distributed:  # what build_adapter checks before it loads anything (under torchrun: it does)
        check_model_files(model, sampling=cfg.sample.enabled)
    return RunPlan(cfg, plain, device, data, validation_data, model, groups, extra_observers, point, held,
                   data_changes, compile_cache_dir(data) if cfg.model.compile != "off" else None,
                   waiting_experts_dir(data))


def check_resume_data(point: ResumePoint, data: Any, allow_changes: bool) -> tuple[str, ...]:
    """The data against the checkpoint's (``wantrain.data.fingerprints``): files added or removed are refused,
    naming them; files whose content or caption changed are refused naming them, unless ``allow_changes``
    (``--allow-data-changes``): then they are returned, for the event log."""
    saved_list = (point.tree.get("data") or {}).get("fingerprint")
    list_changed = saved_list not in (None, data.fingerprint())
    saved_files = point.meta.get("data_files")
    where = f"checkpoint '{point.checkpoint}' was trained on other data"
    if not isinstance(saved_files, dict):  # written before checkpoints carried fingerprints: the clip list only
        if list_changed:
            raise UserError(f"{where} (files were added, removed or renamed in the dataset folders since); restore "
                            "the data or start a new run")
        return ()
    diff = compare_data(saved_files, file_fingerprints(data.clips), caption_files(data.clips))
    if diff.added or diff.removed or list_changed:
        parts = [f"{kind}: {name_some(files)}" for kind, files in
                 (("added", diff.added), ("removed", diff.removed), ("changed", diff.changed)) if files]
        if not (diff.added or diff.removed):
            parts.append("the clips cut from the media differ" if diff.changed else "the clip order differs")
        raise UserError(f"{where}; " + "; ".join(parts) + " (its data position counts the clips it was saved "
                        "with: restore the data or start a new run)")
    if diff.changed and not allow_changes:
        raise UserError(f"{where}: {len(diff.changed)} file(s) changed since it was saved: {name_some(diff.changed)}"
                        "; restore them, start a new run, or pass --allow-data-changes to train on them as they are "
                        "now (the change is recorded in the event log)")
    if diff.changed:
        log.warning("data_changed_on_resume", checkpoint=str(point.checkpoint), changed=list(diff.changed))
    return diff.changed


def build_validation_data(cfg: Any, spec: Any, seed: int) -> TrainingData:
    """The validation clips of ``cfg.validation`` (a ``RunConfig``) as a ``TrainingData`` of one-clip batches in
    folder order: ``validation.path`` read with the ``[data]`` settings, or the first ``from_training`` training
    clips; at most ``max_clips``. Decodes nothing (:func:`plan_run` calls it: a missing or empty folder is refused
    before the run directory exists)."""
    v = cfg.validation
    if v.path is not None:
        data_cfg = attrs.evolve(cfg.data, path=v.path, metadata=None, datasets=[], repeats=1)
    else:
        data_cfg = attrs.evolve(cfg.data, datasets=[attrs.evolve(d, repeats=1) for d in cfg.data.datasets],
                                repeats=1)
    data_cfg = attrs.evolve(data_cfg, shuffle=False, remainder="smaller_batch")
    full = build_dataset(data_cfg, spec=spec, seed=seed, batch_size=1, warn_skipped=v.path is not None)
    limit = min(v.max_clips, v.from_training or v.max_clips)
    return TrainingData(full.clips[:limit], full.report, batch_size=1, remainder="smaller_batch", shuffle=False,
                        seed=seed, spec=spec, draw_captions=False)
