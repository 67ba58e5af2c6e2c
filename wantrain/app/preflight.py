"""The pre-flight: the list of every capability's refusals and the one pass that asks them all
(:func:`problems`), and what ``wantrain check`` makes of a config (:func:`preflight_report`: the pass, the files,
the data report and the plans, without the data, the weights or the GPU where those are not there yet).

``wantrain run``'s pre-flight is ``app.run_plan.plan_run`` (the same pass, then the data, the checkpoint and the
plans it loads with). The plans are their own modules: ``app.memory_plan`` (device and host memory),
``app.device_plan`` (the device, the attention kernel, the compile), ``app.launch`` (the ranks), ``app.notes``
(the warnings). A dataset with nothing usable raises :class:`NoUsableSample`, which carries the full report (every
skipped and ignored file) for ``wantrain check`` to print."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from wantrain.app.device_plan import compute_dtype, planned_device, speed_plan
from wantrain.app.epochs import resolve_epochs
from wantrain.app.launch import (
    device_problems,
    layout_problems,
    lr_finder_launch_problems,
    sequence_bucket_problems,
)
from wantrain.app.layouts import problems as layout_config_problems
from wantrain.app.memory_plan import plan_memory
from wantrain.app.notes import config_warnings, data_warnings
from wantrain.app.observers import require_wandb, resolve_extra_observers
from wantrain.core.errors import UserError
from wantrain.core.problems import Machine, Problem, Rule, asked, refuse
from wantrain.data import build_dataset
from wantrain.data.dataset import NoUsableSample, frame_bucket_problems
from wantrain.data.report import PreflightReport
from wantrain.models.wan22 import check_model_files
from wantrain.models.wan22.lora_files import resolve_init
from wantrain.models.wan22.rules import adapter_problems, lora_problems, model_problems
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.alpha.config import alpha_schedule_problems
from wantrain.observers.evaluation.config import evaluation_problems, section_file_problems
from wantrain.observers.lr_finder.config import lr_finder_problems
from wantrain.optimizers.registry import optimizer_problems
from wantrain.schedulers import check_scheduler, scheduler_problems

__all__ = ["MissingModelFiles", "NoUsableSample", "declared_rules", "preflight_report", "problems"]

SECTION_CHECKS: tuple[Callable[..., list[Problem]], ...] = (model_problems, lora_problems)
"""The rules of one section's keys among themselves: asked when the section is built (``ModelConfig(...)``)."""

CONFIG_CHECKS: tuple[Callable[[Any], list[Problem]], ...] = (
    adapter_problems,  # the model plug-in: the adapter type against the weights' storage and layout
    optimizer_problems,  # per-expert LRs, an alpha change carrying the optimizer's state
    alpha_schedule_problems,
    lr_finder_problems,
    evaluation_problems,
    layout_config_problems,  # the several-GPU layouts against the optimizer and the alpha schedule
    lambda cfg: frame_bucket_problems(cfg.data, variant_spec(cfg.model.variant)),
)
"""The rules across sections, each declared by the capability that cannot take the other: asked when the run
config is built (``RunConfig``), so that the loader reports them with the document's other problems."""


def _scheduler_problems(cfg: Any, machine: Machine) -> list[Problem]:
    from wantrain.app.epochs import uses_epochs

    return [] if uses_epochs(cfg) else scheduler_problems(cfg.lr_scheduler, cfg.train.max_steps)


def _speed_problems(cfg: Any, machine: Machine) -> list[Problem]:
    """The attention kernel and the compile on the run's device (``check`` plans: CUDA when the config says so)."""
    from wantrain.models.wan22.attention import kernel_problems
    from wantrain.models.wan22.compile import compiler_problems

    if device_problems(cfg, machine):
        return []  # no device to judge them on: its own problem says so
    device = planned_device(cfg.train.device)
    return [*kernel_problems(cfg.model.attention, device, compute_dtype(cfg.model)),
            *compiler_problems(cfg.model.compile, device)]


LAUNCH_CHECKS: tuple[Callable[[Any, Machine], list[Problem]], ...] = (
    device_problems, layout_problems, _speed_problems, _scheduler_problems, lr_finder_launch_problems)
"""The rules of the config against the machine and the launch (ranks, devices, installed kernels, --resume)."""


def declared_rules() -> tuple[Rule, ...]:
    """Every refusal rule the capabilities declare (``core.problems.Rule``): what the pre-flight can report, and
    the source of docs/config.md's compose table (its pairs)."""
    from wantrain.app.launch import LAUNCH_RULES
    from wantrain.app.layouts import LAYOUT_RULES
    from wantrain.data.dataset import DATA_RULES
    from wantrain.models.wan22.attention import KERNEL_RULES
    from wantrain.models.wan22.compile import COMPILE_RULES
    from wantrain.models.wan22.rules import ADAPTER_RULES, LORA_RULES, MODEL_RULES
    from wantrain.observers.alpha.config import ALPHA_RULES
    from wantrain.observers.evaluation.config import EVALUATION_RULES
    from wantrain.observers.lr_finder.config import LR_FINDER_RULES
    from wantrain.optimizers.registry import OPTIMIZER_RULES
    from wantrain.schedulers import SCHEDULER_RULES

    return (*MODEL_RULES, *LORA_RULES, *ADAPTER_RULES, *KERNEL_RULES, *COMPILE_RULES, *DATA_RULES, *OPTIMIZER_RULES,
            *SCHEDULER_RULES, *ALPHA_RULES, *LR_FINDER_RULES, *EVALUATION_RULES, *LAUNCH_RULES,
            *LAYOUT_RULES)


def config_problems(cfg: Any) -> list[Problem]:
    """Every problem of the run config ``cfg`` across its sections (:data:`CONFIG_CHECKS`)."""
    return [p for check in CONFIG_CHECKS for p in asked(check, cfg)]


def problems(cfg: Any, machine: Machine) -> list[Problem]:
    """The pre-flight: every problem of ``cfg`` on ``machine``, from every capability at once (the sections' own
    rules, the rules across sections, the launch's), before anything is loaded or written. ``prepare`` refuses
    with all of them; ``wantrain check`` prints them."""
    sections = [p for check, section in zip(SECTION_CHECKS, (cfg.model, cfg.lora), strict=True) for p in check(section)]
    return [*sections, *config_problems(cfg), *(p for check in LAUNCH_CHECKS for p in check(cfg, machine))]


def dataset(cfg: Any) -> Any:
    """The run's training data as ``prepare()`` reads it (probes and plans; decodes nothing)."""
    return build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)


def resolved_config(cfg: Any) -> Any:
    """``cfg`` with its epoch keys as optimizer steps (the dataset is planned only when one is set)."""
    from wantrain.app.epochs import uses_epochs

    return resolve_epochs(cfg, dataset(cfg)) if uses_epochs(cfg) else cfg


def preflight_report(cfg: Any, *, verify: bool = False, config_dir: Path | None = None,
                     gpus: int | None = None) -> PreflightReport:
    """The pre-flight data report of ``wantrain check`` (``verify``: decode every clip first), with the memory plan
    (:func:`plan_memory`: training and, with ``[sample]`` on, sampling, part by part). First the pre-flight that
    ``wantrain run`` makes (:func:`problems`, every problem at once), then the checks of files and code it makes
    before it loads anything (users' observers, the model files, [validation]/[sample] files), so ``check`` passes
    only a config that ``run`` accepts as far as files and keys go. ``check`` plans for the machine the run will
    have: without the weights (from the variant's architecture), without the data (from the config's buckets,
    when a data folder is not there: one line says so) and for ``train.device = "cuda"`` on a machine without CUDA
    (one line says this machine cannot run it). ``gpus`` (``check --gpus N``): the launch and the host plan are
    those of N torchrun ranks on one machine."""
    from wantrain.app.epochs import uses_epochs
    from wantrain.app.launch import device_note
    from wantrain.data.dataset import missing_data, planned_data

    machine = Machine.here(world_size=gpus or 1, planning=True)
    spec = variant_spec(cfg.model.variant)
    # the config's rules and [validation] / [sample]'s files, every problem at once
    refuse([*problems(cfg, machine), *section_file_problems(cfg.validation, cfg.sample, spec,
                                                            cfg.model.trained_experts)])
    notes = [note] if (note := device_note(cfg, machine)) else []
    given = cfg
    resolve_extra_observers(cfg, config_dir)
    if cfg.observers.wandb:
        require_wandb()
    missing = missing_model_files(cfg.model)
    if not missing:  # weights still to download: the plan below is made from the variant's architecture alone
        check_model_files(cfg.model, sampling=cfg.sample.enabled)
    absent = missing_data(cfg.data)
    if absent:  # the data is not there yet: the plan is made from the config's buckets
        data = planned_data(cfg.data, spec=variant_spec(cfg.model.variant), batch_size=cfg.train.batch_size)
        notes.append(f"data not found ({', '.join(absent)}): the plan is made from the config's buckets "
                     f"({len(data.report.buckets)}, every size and frame count of [data]), the largest counted")
    else:
        data = dataset(cfg)
        if verify:
            data.verify_all()
        if uses_epochs(cfg):
            cfg = resolve_epochs(cfg, data)  # the epoch keys as optimizer steps, into the report
            check_scheduler(cfg.lr_scheduler, cfg.train.max_steps)
        refuse(sequence_bucket_problems(cfg, data.report.buckets, getattr(data, "clips", ())))
        data.report.warnings.extend(config_warnings(cfg, given))  # an epoch-length run with an idle expert refuses
        data.report.warnings.extend(data_warnings(data))
    data.report.warnings[:0] = notes
    if cfg.lora.starts_from_files:  # rank and alpha of the lora.init_from* files (their headers; no model loads)
        lora, _ = resolve_init(cfg.lora, cfg.model)
        cfg = attrs.evolve(cfg, lora=lora)
    data.report.model_files = [f"problem: {line}" for line in missing] if missing else model_plan(cfg)
    speed_plan(cfg, data, planned_device(cfg.train.device))
    try:
        plan_memory(cfg, data, gpus=gpus)
    except UserError as exc:
        if notes and device_note(cfg, machine) and str(exc).startswith("host memory:"):
            # planned for the machine the run will have: this one's RAM is no refusal, but worth a line
            data.report.warnings.append(f"on this machine: {exc}")
        elif not missing:
            raise
        else:
            raise MissingModelFiles(data.report, missing, also=str(exc)) from None  # the device plan stays
    if missing:
        raise MissingModelFiles(data.report, missing)
    return data.report


class MissingModelFiles(UserError):
    """Model files the config names that are not on disk yet (every one), raised once the report, with the memory
    and host plans made from the variant's architecture, is complete: ``wantrain check`` prints it, then this."""

    def __init__(self, report: PreflightReport, missing: list[str], *, also: str | None = None) -> None:
        super().__init__(f"{len(missing)} model file{'s' if len(missing) > 1 else ''} missing: " + "; ".join(missing)
                         + " (the memory plan above is made from the variant's architecture)"
                         + (f"; and {also}" if also else ""))
        self.report = report


MODEL_FILE_KEYS = ("path", "high_noise_file", "low_noise_file", "transformer_file", "vae_file", "text_encoder_file",
                   "tokenizer_path")
"""The ``[model]`` keys that name weights on disk."""


def missing_model_files(model: Any) -> list[str]:
    """One line per ``[model]`` file key that names something not on disk, and for a real variant without
    ``model.path`` or any file key, that it is unset: every one at once (``check`` before the download). Empty when
    nothing is missing (the run's own checks then judge what is there)."""
    if variant_spec(model.variant).tiny and model.path is None:
        return []
    missing = [f"model.{key} '{Path(value).expanduser()}' " + ("is not a directory (expected a diffusers-format "
               "model folder)" if key == "path" else "does not exist") for key in MODEL_FILE_KEYS
               if (value := getattr(model, key)) is not None and not Path(value).expanduser().exists()]
    if model.path is None and not any(getattr(model, key) is not None for key in MODEL_FILE_KEYS):
        missing.append(f"model.path is required for {model.variant}: its weights as a diffusers-format folder, or "
                       "each part as a file (docs/models.md)")
    return missing


def model_plan(cfg: Any) -> list[str]:
    """What the run will load from where (checked as the run checks it; a problem is reported as its one line)."""
    from wantrain.models.wan22.loading import WeightSource
    from wantrain.models.wan22.model_files import plan_lines

    try:
        source = WeightSource(cfg.model, cfg.run.seed)
    except UserError as exc:
        return [f"problem: {exc}"]
    return plan_lines(cfg.model, source.spec, random=source.random)
