"""What ``wantrain check`` and ``wantrain cache`` do with a config (the CLI parses and prints): the pre-flight data
report, and filling the latent/text cache. A dataset with nothing usable raises :class:`NoUsableSample`, which
carries the full report (every skipped and ignored file) for ``wantrain check`` to print."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from wantrain.app.epochs import resolve_epochs
from wantrain.app.launch import (
    check_parallel,
    check_sequence_buckets,
    device_problems,
    layout_problems,
    lr_finder_launch_problems,
    parallel_notes,
    sequence_bucket_problems,
)
from wantrain.app.layouts import problems as layout_config_problems
from wantrain.app.observers import require_wandb, resolve_extra_observers
from wantrain.core.errors import UserError
from wantrain.core.problems import Machine, Problem, Rule, refuse
from wantrain.data import CacheStats, build_dataset, ensure_cache
from wantrain.data.cache import describe_entries, remove_entries
from wantrain.data.dataset import NoUsableSample, frame_bucket_problems
from wantrain.data.report import PreflightReport
from wantrain.models.wan22 import build_encoders, check_model_files
from wantrain.models.wan22.adapter_types import adapter_type
from wantrain.models.wan22.config import adapter_problems, lora_problems, model_problems
from wantrain.models.wan22.lora_files import resolve_init
from wantrain.models.wan22.variants import variant_spec
from wantrain.models.wan22.waiting import problems as waiting_problems
from wantrain.observers.alpha.config import alpha_schedule_problems
from wantrain.observers.evaluation.config import check_sections, evaluation_problems, sample_size
from wantrain.observers.lr_finder.config import lr_finder_problems
from wantrain.optimizers.registry import optimizer_problems
from wantrain.schedulers import check_scheduler, scheduler_problems

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
    from wantrain.models.wan22.config import ADAPTER_RULES, LORA_RULES, MODEL_RULES
    from wantrain.observers.alpha.config import ALPHA_RULES
    from wantrain.observers.evaluation.config import EVALUATION_RULES
    from wantrain.observers.lr_finder.config import LR_FINDER_RULES
    from wantrain.optimizers.registry import OPTIMIZER_RULES
    from wantrain.schedulers import SCHEDULER_RULES

    return (*MODEL_RULES, *LORA_RULES, *ADAPTER_RULES, *KERNEL_RULES, *COMPILE_RULES, *DATA_RULES, *OPTIMIZER_RULES,
            *SCHEDULER_RULES, *ALPHA_RULES, *LR_FINDER_RULES, *EVALUATION_RULES, *LAUNCH_RULES,
            *LAYOUT_RULES)


def compose_markdown() -> str:
    """docs/config.md's table of what composes with what, generated from the rules that refuse a pair
    (:func:`declared_rules`; a test keeps the page equal to it)."""
    rows = sorted((r for r in declared_rules() if r.pair is not None), key=lambda r: (r.pair[0], r.pair[1]))
    lines = ["## What composes with what", "",
             "Every pair of settings the pre-flight refuses (generated from the capabilities' declared rules; any",
             "pair not listed composes). `wantrain check` reports each one it finds, with the others, before",
             "anything is loaded or written; the rule id names the rule in the code.", "",
             "| setting | does not compose with | rule | why |", "|---|---|---|---|"]
    lines += [f"| {r.pair[0]} | {r.pair[1]} | `{r.id}` | {r.summary} |" for r in rows]
    return "\n".join(lines) + "\n"


def config_problems(cfg: Any) -> list[Problem]:
    """Every problem of the run config ``cfg`` across its sections (:data:`CONFIG_CHECKS`)."""
    return [p for check in CONFIG_CHECKS for p in check(cfg)]


def problems(cfg: Any, machine: Machine) -> list[Problem]:
    """The pre-flight: every problem of ``cfg`` on ``machine``, from every capability at once (the sections' own
    rules, the rules across sections, the launch's), before anything is loaded or written. ``prepare`` refuses
    with all of them; ``wantrain check`` prints them."""
    sections = [p for check, section in zip(SECTION_CHECKS, (cfg.model, cfg.lora), strict=True) for p in check(section)]
    return [*sections, *config_problems(cfg), *(p for check in LAUNCH_CHECKS for p in check(cfg, machine))]


def compute_dtype(model: Any) -> torch.dtype:
    """The dtype the blocks compute in: fp32 for ``base_dtype = "fp32"`` (and ``auto`` on a tiny twin), else bf16."""
    fp32 = model.base_dtype == "fp32" or (model.base_dtype == "auto" and variant_spec(model.variant).tiny)
    return torch.float32 if fp32 else torch.bfloat16


def planned_device(name: str) -> torch.device:
    """The device the run trains on, as planned: ``auto`` is CUDA where this machine has it; a named device as
    named, whether or not this machine has it (``device_problems`` judges that)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)


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
    refuse(problems(cfg, machine))
    notes = [note] if (note := device_note(cfg, machine)) else []
    given = cfg
    resolve_extra_observers(cfg, config_dir)
    if cfg.observers.wandb:
        require_wandb()
    missing = missing_model_files(cfg.model)
    if not missing:  # weights still to download: the plan below is made from the variant's architecture alone
        check_model_files(cfg.model, sampling=cfg.sample.enabled)
    check_sections(cfg.validation, cfg.sample, variant_spec(cfg.model.variant), cfg.model.trained_experts)
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
        refuse(sequence_bucket_problems(cfg, data.report.buckets))
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


def config_warnings(cfg: Any, given: Any) -> list[str]:
    """One line each for what a user could mean but probably does not (``check`` prints them after its report, a
    run logs them as ``config_warning``): an expert without an optimizer step when the length comes from
    ``train.max_steps`` (with epochs that is refused here), a LoRA rank wider than the layers it adapts.
    ``cfg``: with epochs resolved into steps; ``given``: as the user wrote it."""
    from wantrain.app.epochs import check_every_expert_trains
    from wantrain.models.wan22.config import check_rank

    found = [check_every_expert_trains(cfg, user_cfg=given), check_rank(cfg.model.variant, cfg.lora.rank)]
    return [line for line in found if line]


def data_warnings(data: Any) -> list[str]:
    """One line when videos train as stills: shorter than every multi-frame bucket of their ``data.frames``, they
    fall to the 1-frame bucket (musubi's ``frames = [1, 25, 45]`` on clips of 14-22 frames) -- how many, their
    share of the videos, and the bucket that would keep them moving."""
    available = {r["path"]: r["frames"] for r in data.report.retimed}
    stills: dict[str, int] = {}
    videos = set()
    for clip in data.clips:
        if clip.kind != "video":
            continue
        videos.add(str(clip.path))
        if clip.frames == 1 and any(b > 1 for b in clip.frame_buckets):
            stills[str(clip.path)] = available.get(str(clip.path), clip.source_frames)
    if not stills:
        return []
    buckets = sorted(data.clips[0].frame_buckets)
    fits = (min(stills.values()) - 1) // 4 * 4 + 1  # Wan's frame counts are 4k + 1
    return [f"{len(stills)} of {len(videos)} videos ({100 * len(stills) / len(videos):.0f} %) are shorter than every "
            f"frame bucket above 1 (the shortest is {min(b for b in buckets if b > 1)} frames; they have "
            f"{min(stills.values())}-{max(stills.values())} after retiming) and train as single frames: add a "
            + (f"bucket they reach, e.g. data.frames = {sorted({*buckets, fits})}" if fits > 1
               else "shorter bucket or use longer clips")]


def alpha_schedule_lines(cfg: Any) -> list[str]:
    """``wantrain check``'s lines on an enabled ``[lora.alpha_schedule]``: per phase the smallest slope its window
    resolves, and whether every phase is reachable within ``train.max_steps`` (docs/alpha_schedule.md)."""
    from wantrain.observers.alpha.report import resolution_lines

    if not cfg.lora.schedule_enabled:
        return []
    experts = len(cfg.model.trained_experts)
    return resolution_lines(cfg.lora.alpha_schedule, experts, cfg.train.max_steps)


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a device (``auto``: CUDA when this machine has it); its problems
    (:func:`app.launch.device_problems`) refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    refuse(device_problems(SimpleNamespace(train=SimpleNamespace(device=name)), Machine.here()))
    return torch.device(name)


def fill_cache(cfg: Any) -> tuple[CacheStats, PreflightReport]:
    """Encode what the cache lacks (``wantrain cache``) with the VAE and the text encoder alone, on the training
    device (no transformer is loaded: caching needs none); the stats (with the entries this config does not
    use, left in place) and the data report."""
    data = dataset(cfg)
    encoders = build_encoders(cfg.model, cfg.lora, seed=cfg.run.seed, device=resolve_device(cfg.train.device))
    return ensure_cache(data, encoders, remove_orphans=False), data.report


__all__ = ["NoUsableSample", "check_parallel", "check_sequence_buckets", "dataset", "describe_entries",
           "fill_cache", "parallel_notes", "plan_memory", "preflight_report", "remove_entries", "resolve_device",
           "resolved_config"]


def model_plan(cfg: Any) -> list[str]:
    """What the run will load from where (checked as the run checks it; a problem is reported as its one line)."""
    from wantrain.models.wan22.loading import WeightSource
    from wantrain.models.wan22.model_files import plan_lines

    try:
        source = WeightSource(cfg.model, cfg.run.seed)
    except UserError as exc:
        return [f"problem: {exc}"]
    return plan_lines(cfg.model, source.spec, random=source.random)


def speed_plan(cfg: Any, data: Any, device: torch.device) -> dict[str, Any]:
    """The attention kernel (``model.attention``) and the compile plan (``model.compile``) of a run on ``device``,
    into ``data.report.speed`` (``check`` prints its lines; the run's ``preflight.json``). A kernel whose package is
    missing or that the device cannot run, or a compile the toolchain cannot do, was reported by the pre-flight
    (:func:`problems`) already; refused here too for a caller in code. The compile cache is ``torch_compile/`` in the
    data's cache folder."""
    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.attention import check_kernel
    from wantrain.models.wan22.compile import CompilePlan, check_compiler

    model = cfg.model
    spec = variant_spec(model.variant)
    fp32 = model.base_dtype == "fp32" or (model.base_dtype == "auto" and spec.tiny)
    kernel = check_kernel(model.attention, device, torch.float32 if fp32 else torch.bfloat16)
    check_compiler(model.compile, device)
    cache = compile_cache_dir(data) if model.compile != "off" else None
    plan = CompilePlan(model.compile, model.compile_dynamic, transformer_kwargs(spec)["num_layers"], cache)
    speed = {"attention": kernel.name, "attention_backend": kernel.backend, "compile": plan.to_json(),
             "lines": [f"attention: {kernel.name} ({kernel.describe}; diffusers backend '{kernel.backend}')",
                       *plan.lines()]}
    data.report.speed = speed
    return speed


def compile_cache_dir(data: Any) -> Path | None:
    """``torch_compile/`` in the cache folder of the run's first clip (``data.cache_dir`` or the dataset's
    ``.wantrain_cache``); None without clips."""
    clips = getattr(data, "clips", None)
    return Path(clips[0].cache_dir) / "torch_compile" if clips else None


def waiting_experts_dir(data: Any) -> Path | None:
    """``waiting_experts/`` in the cache folder of the run's first clip: where ``model.waiting_expert = "disk"``
    keeps the experts' waiting files (``models/wan22/waiting.py``)."""
    clips = getattr(data, "clips", None)
    return Path(clips[0].cache_dir) / "waiting_experts" if clips else None


LARGEST_DEVICE_GIB = 288.0
"""About the memory of the largest single accelerators sold (B300, MI355X: 288 GB): a plan that needs more with its
smallest setting fits no device, and is refused by ``check`` and ``run`` alike."""


def plan_memory(cfg: Any, data: Any, *, gpus: int | None = None) -> Any:
    """The ``[model]`` section the run trains with: with ``model.vram_budget_gb`` the planner's choice of
    ``base_dtype`` (when ``auto``), ``blocks_to_swap`` and ``offload_activations`` for the largest bucket, else the
    section as it is. With ``[sample]`` on, the plan covers sampling at the sample size too (the card needs the
    larger peak). The estimate, part by part, goes into ``data.report.memory_plan`` (``wantrain check`` prints it;
    the run's ``preflight.json``). A budget nothing fits is a one-line ``UserError`` naming the smallest setting
    and what would fit; so is a plan no device fits (:data:`LARGEST_DEVICE_GIB`)."""
    import attrs

    from wantrain.models.wan22.memory import AdapterSpec, MemorySettings, SampleSize, estimate, plan

    model = cfg.model
    buckets = data.report.buckets
    if not buckets:
        return model
    spec = variant_spec(model.variant)
    b = max(buckets, key=lambda r: (r.width * r.height * r.frames, r.frames))
    size = dict(width=b.width, height=b.height, frames=b.frames, rank=_lora_rank(cfg), batch=cfg.train.batch_size,
                adapter=AdapterSpec.of(cfg.lora))
    if cfg.sample.enabled:
        size["sample"] = SampleSize(*sample_size(cfg.sample, spec), guidance=cfg.sample.guidance_scale > 1)
    dtype = model.base_dtype
    if dtype == "auto" and spec.tiny:
        dtype = "fp32"
    if dtype == "auto" and adapter_type(cfg.lora.type).reads_base:  # DoRA: the budget plans bf16, never fp8
        dtype = "bf16"
    # model.recompute 'auto' without a budget is the whole block (recompute.py); with one the planner chooses
    recompute = "lean" if model.recompute == "lean" and model.gradient_checkpointing else "block"
    if model.vram_budget_gb is None:
        settings = MemorySettings("bf16" if dtype == "auto" else dtype, model.blocks_to_swap, model.offload_activations,
                                  recompute)
        chosen = estimate(model.variant, settings, **size, attention=model.attention,
                          gradient_checkpointing=model.gradient_checkpointing)
        if chosen.device_gib > LARGEST_DEVICE_GIB and plan(model.variant, LARGEST_DEVICE_GIB, base_dtype=dtype,
                                                           **size)[0] is None:
            _, smallest = plan(model.variant, 0.0, base_dtype=dtype, **size)
            raise UserError(
                f"the largest bucket {b.width}x{b.height}x{b.frames} needs {smallest.device_gib:,.0f} GiB of device "
                f"memory even with the smallest setting ({smallest.settings.describe()}), more than any accelerator "
                f"has (the largest hold about {LARGEST_DEVICE_GIB:g} GiB); lower data.resolutions, data.frames, "
                "train.batch_size or lora.rank"
            )
    else:
        chosen, smallest = plan(model.variant, model.vram_budget_gb, base_dtype=dtype, **size,
                                attention=model.attention,
                                recompute=model.recompute if model.gradient_checkpointing else "block")
        if chosen is None:
            raise UserError(
                f"model.vram_budget_gb = {model.vram_budget_gb:g}: nothing fits the largest bucket "
                f"{b.width}x{b.height}x{b.frames} (the smallest setting, {smallest.settings.describe()}, needs "
                f"{smallest.device_gib:.1f} GiB); {_what_fits(model.variant, model.vram_budget_gb, dtype, size)}"
            )
        model = attrs.evolve(model, vram_budget_gb=None, blocks_to_swap=chosen.settings.blocks_to_swap,
                             offload_activations=chosen.settings.offload_activations,
                             recompute=chosen.settings.recompute if model.gradient_checkpointing else model.recompute,
                             base_dtype=model.base_dtype if dtype != "auto" else chosen.settings.base_dtype)
    _record_plan(cfg, data, b, chosen)  # the device plan, should the host plan refuse
    model, chosen, host = plan_host(cfg, model, chosen, size, auto_dtype=dtype == "auto", gpus=gpus)
    _record_plan(cfg, data, b, chosen)
    data.report.host_memory = host
    return model


def _record_plan(cfg: Any, data: Any, b: Any, chosen: Any) -> None:
    lines = chosen.lines()
    if cfg.model.vram_budget_gb is not None:  # the budget is the usable memory the card figure is held against
        budget = cfg.model.vram_budget_gb
        lines.append(f"  {'usable memory':<28} {budget:7.2f} GiB (model.vram_budget_gb; "
                     f"{budget - chosen.device_gib:.2f} GiB of it to spare)")
    data.report.memory_plan = {"budget_gib": cfg.model.vram_budget_gb, "bucket": f"{b.width}x{b.height}x{b.frames}",
                               "lines": lines, **chosen.to_json()}


def plan_host(cfg: Any, model: Any, chosen: Any, size: dict, *, auto_dtype: bool,
              gpus: int | None = None) -> tuple[Any, Any, dict]:
    """Fit the host plan to the host RAM budget (``model.host_ram_budget_gb``, else this machine's available RAM):
    the VRAM plan ``chosen`` as it is, then (``base_dtype = "auto"``) its fp8 counterpart, each pinned and then
    pageable; then (``model.waiting_expert = "auto"`` with two trained experts) the same with the waiting expert on
    disk. Returns (the model section to run with, the device estimate, the host lines for ``check``); nothing
    that fits is a one-line ``UserError`` naming the smallest plan and what would fit."""
    from wantrain.models.wan22.memory import GIB, available_host_bytes, estimate, plan

    stated = model.host_ram_budget_gb
    budget = stated * GIB if stated is not None else available_host_bytes()
    where = (f"model.host_ram_budget_gb = {stated:g}" if stated is not None
             else f"this machine's available RAM ({budget / GIB:.1f} GiB)")

    def options():
        yield model, chosen
        # fp8 halves the host copies of the blocks' Linears (it needs gradient checkpointing: ModelConfig)
        if auto_dtype and chosen.settings.base_dtype == "bf16" and model.gradient_checkpointing:
            if cfg.model.vram_budget_gb is not None:
                fp8_est, _ = plan(model.variant, cfg.model.vram_budget_gb, base_dtype="fp8", **size,
                                  attention=chosen.attention_kernel, recompute=cfg.model.recompute)
            else:
                fp8_est = estimate(model.variant, attrs.evolve(chosen.settings, base_dtype="fp8"), **size,
                                   attention=chosen.attention_kernel)
            if fp8_est is not None:
                yield attrs.evolve(model, base_dtype="fp8", blocks_to_swap=fp8_est.settings.blocks_to_swap,
                                   offload_activations=fp8_est.settings.offload_activations,
                                   recompute=fp8_est.settings.recompute), fp8_est

    # the waiting expert on disk (models/wan22/waiting.py) last: each switch then reads an expert from the disk
    wait = ("resident", "disk") if model.waiting_expert == "auto" and not waiting_problems(model, "disk") \
        else (model.waiting_expert,)
    pins = (True, False) if model.pin_host_copies else (False,)
    seen, fresh = [], options()

    def each_option():  # options(), each planned once and only when reached
        yield from seen
        for item in fresh:
            seen.append(item)
            yield item

    tried = []
    for waiting in wait:
        for option, device_est in each_option():
            for pin in pins:
                candidate = attrs.evolve(option, pin_host_copies=pin, waiting_expert=waiting)
                est = host_estimate_of(cfg, candidate, device_est.settings, size, gpus=gpus)
                tried.append((candidate, est))
                if est.peak <= budget:
                    changes = _host_changes(model, candidate)
                    head = [f"  budget {budget / GIB:.2f} GiB ({where}): fits"
                            + (f" with {changes} (the plan as configured needs {tried[0][1].peak / GIB:.1f} GiB)"
                               if changes else "")]
                    return candidate, device_est, {"budget_gib": budget / GIB, "lines": head + est.lines(),
                                                   "cuda": _trains_on_cuda(cfg, model), **est.to_json()}
    first, smallest = tried[0], min(tried, key=lambda t: t[1].peak)
    best = _host_changes(model, smallest[0])
    raise UserError(
        f"host memory: the run needs {first[1].peak / GIB:.1f} GiB of RAM at its peak ({first[1].peak_phase}; "
        f"largest part: {first[1].dominant}) but {where} is {budget / GIB:.1f} GiB; "
        + (f"the smallest plan ({best}) needs {smallest[1].peak / GIB:.1f} GiB; " if best else "")
        + "free RAM, train one expert (model.experts), use fewer frames, or set model.host_ram_budget_gb for the "
        f"machine that will run it (at least {smallest[1].peak / GIB:.1f})"
    )


def _host_changes(configured: Any, chosen: Any) -> str:
    """What the host plan changed in the (VRAM-planned) model section ``configured``, in config keys (empty:
    nothing)."""
    out = []
    if chosen.base_dtype != configured.base_dtype:
        out.append(f'base_dtype = "{chosen.base_dtype}"')
    if chosen.pin_host_copies != configured.pin_host_copies:
        out.append("pin_host_copies = false")
    if chosen.waiting_expert == "disk" and configured.waiting_expert != "disk":
        out.append('waiting_expert = "disk"')
    return " and ".join(out)


def _trains_on_cuda(cfg: Any, model: Any) -> bool:
    """A real model is taken to train on CUDA unless ``train.device`` says otherwise (pinned copies)."""
    device = str(cfg.train.device)
    return device.startswith("cuda") or (device == "auto" and not variant_spec(model.variant).tiny)


def host_estimate_of(cfg: Any, model: Any, settings: Any, size: dict, *, gpus: int | None = None) -> Any:
    """The run's host memory, part by part (``memory.host_estimate``): the encoders are counted as loaded (they
    are not when every clip and caption is cached already and [sample] is off), in the order the run loads them:
    in one process before the experts (``app.assemble.encode_before_the_experts``), under torchrun after them; the
    pin budget is half of ``model.host_ram_budget_gb`` (else of the machine's memory), as the placement takes it.
    The figures are one rank's; with ranks (``gpus``, or torchrun's ``LOCAL_WORLD_SIZE`` per machine) the
    machine's sum follows (:func:`_ranks_on_host`), and under ``model.parallel = "fsdp"`` the loading rank (rank 0,
    or each expert group's leader) holds the expert whole while loading, the others none of it."""
    from wantrain.core.parallel.distributed import detect_topology
    from wantrain.models.wan22.memory import host_estimate
    from wantrain.models.wan22.placement import host_experts, pin_budget

    # sampling with one trained A14B expert loads the other one frozen (adapter.add_sampling_expert); with expert
    # groups each rank holds one expert and the other group's is relayed (a torchrun launch: encoders after)
    experts, other = host_experts(model, cfg.sample.enabled)
    launched = detect_topology().distributed or model.expert_groups > 1
    ranks, on_host = _ranks_on_host(gpus)
    launched = launched or ranks > 1
    load: dict[str, Any] = {}
    if model.parallel == "fsdp" and ranks > 1:
        from wantrain.models.wan22.rank_plan import load_peak

        groups = max(model.expert_groups, 1)
        group = max(ranks // groups, 1)
        source = load_peak(model.variant, model.shard_degree or group, size["rank"],
                           dtype_name="fp32" if settings.base_dtype == "fp32" else "bf16").rank0_host
        # the leaders on the first machine: ranks 0, group, 2 x group ... below the ranks it holds
        load = dict(load_source=source, loaders_on_host=min(groups, -(-on_host // group)))
    return host_estimate(model.variant, settings, experts=experts, cuda=_trains_on_cuda(cfg, model),
                         sampling_only=other, pin=model.pin_host_copies,
                         pin_budget=pin_budget(model.host_ram_budget_gb), encoders_first=not launched,
                         ranks_on_host=on_host, waiting=model.waiting_expert, switch_every=model.switch_every,
                         **load, **{k: v for k, v in size.items() if k != "sample"})


def _ranks_on_host(gpus: int | None) -> tuple[int, int]:
    """(ranks in all, ranks on the first machine): ``check --gpus N`` plans N ranks on one machine; under torchrun
    its ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; else one process."""
    import os

    from wantrain.core.parallel.distributed import detect_topology

    if gpus is not None:
        return gpus, gpus
    world = detect_topology().world_size
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world) or world) if world > 1 else 1


def _what_fits(variant: str, budget: float, dtype: str, size: dict) -> str:
    """What would fit ``budget``: fewer frames (training or, when training alone fits, sampling) with the smallest
    setting, or a budget."""
    from wantrain.models.wan22.memory import plan

    sample = size.get("sample")
    if sample is not None and plan(variant, budget, base_dtype=dtype, **{**size, "sample": None})[0] is not None:
        _, smallest = plan(variant, 0.0, base_dtype=dtype, **size)
        head = (f"training fits but sampling does not ([sample] {sample.describe()} needs "
                f"{smallest.sampling_gib:.1f} GiB at best)")
        for f in range(sample.frames - 4, 0, -4):
            if plan(variant, budget, base_dtype=dtype, **{**size, "sample": attrs.evolve(sample, frames=f)})[0]:
                return f"{head}; sample.frames = {f} would fit, or a budget of {_smallest_budget(variant, dtype, size)}"
        return f"{head}; a smaller sample.width/height or a budget of {_smallest_budget(variant, dtype, size)}"
    width, height, frames = size["width"], size["height"], size["frames"]
    for f in range(frames - 4, 0, -4):
        if plan(variant, budget, base_dtype=dtype, **{**size, "frames": f})[0] is not None:
            return f"{f} frames at {width}x{height} would fit, or a budget of {_smallest_budget(variant, dtype, size)}"
    return f"a budget of {_smallest_budget(variant, dtype, size)} would fit"


def _smallest_budget(variant: str, dtype: str, size: dict) -> str:
    from wantrain.models.wan22.memory import plan

    _, smallest = plan(variant, 0.0, base_dtype=dtype, **size)
    return f"{smallest.device_gib:.1f} GiB"


def _lora_rank(cfg: Any) -> int:
    """The LoRA rank the run trains at: ``lora.rank``, or the rank of the ``lora.init_from*`` files (their headers)."""
    if cfg.lora.starts_from_files:
        lora, _ = resolve_init(cfg.lora, cfg.model)
        return lora.rank
    return cfg.lora.rank


def planned_layout(cfg: Any, **degrees: int) -> Any:
    """``wantrain check --gpus N ...``'s layout (``rank_plan.Layout``), checked against the model: one line naming
    what is wrong (a sequence degree not dividing the heads, ...)."""
    from wantrain.models.wan22.rank_plan import Layout, check_layout

    layout = Layout(**degrees)
    check_layout(cfg.model.variant, layout)
    return layout


def expert_group_lines(cfg: Any, gpus: int | None) -> list[str]:
    """``wantrain check``: with ``model.expert_groups``, which ranks train which expert (``models.wan22.placement``);
    with ``model.parallel = "fsdp"`` too, which ranks shard each expert and which rank loads it."""
    from wantrain.models.wan22.placement import expert_group_lines as lines
    from wantrain.models.wan22.variants import VARIANTS

    out = lines(cfg.model, gpus)
    count = cfg.model.expert_groups
    if not out or cfg.model.parallel != "fsdp" or gpus is None or gpus % count:
        return out
    size = gpus // count
    degree = cfg.model.shard_degree or size
    out.append(f"sharding: FSDP inside each expert group (model.parallel = 'fsdp', {degree} GPU(s) per copy of the "
               "expert); each group loads its expert from its first rank, the others start on meta:")
    for g, expert in enumerate(VARIANTS[cfg.model.variant].experts):
        first = g * size
        copies = [f"{c}..{c + degree - 1}" if degree > 1 else str(c) for c in range(first, first + size, degree)]
        out.append(f"  {expert}: loaded on rank {first}, sharded over ranks " + " and ".join(copies)
                   + (f" ({len(copies)} copies, replicated: HSDP)" if len(copies) > 1 else "")
                   + f", each rank holding 1/{degree} of it")
    return out


def layout_lines(cfg: Any, report: Any, layout: Any) -> list[str]:
    """``wantrain check --gpus N ...``: the plan per GPU of ``layout`` (``models.wan22.rank_plan``) for the largest
    bucket of ``report`` (a ``preflight_report``), part by part. ``wantrain run`` trains the data-parallel, the
    FSDP (``model.parallel``), the expert-group (``model.expert_groups``) and the sequence-parallel
    (``model.sequence_degree``, data parallel across the groups) layouts under torchrun, FSDP with a sequence
    degree and FSDP inside expert groups; expert groups with a sequence degree are planned only
    (docs/distributed.md)."""
    from wantrain.models.wan22.memory import AdapterSpec, MemorySettings
    from wantrain.models.wan22.rank_plan import rank_estimate

    bucket = (report.memory_plan or {}).get("bucket")
    if bucket is None:
        return []
    width, height, frames = (int(x) for x in bucket.split("x"))
    # planned as the one-GPU plan was: its settings (dtype, swap, offload, recompute), adapter type and kernel
    settings = MemorySettings(**report.memory_plan["settings"]) if "settings" in report.memory_plan else None
    estimate = rank_estimate(cfg.model.variant, layout, width=width, height=height, frames=frames,
                             rank=_lora_rank(cfg), batch=cfg.train.batch_size, settings=settings,
                             adapter=AdapterSpec.of(cfg.lora), attention=cfg.model.attention,
                             gradient_checkpointing=cfg.model.gradient_checkpointing)
    # wantrain run trains data parallel, fsdp (model.parallel), expert groups and Ulysses, each alone, Ulysses with
    # fsdp (the sequence groups folded into the shard dimension) and fsdp inside expert groups
    runs = layout.expert_groups == 1 or layout.sequence_degree == 1
    status = "trainable under torchrun" if runs else "planned, not yet trainable"
    described = settings.describe() if settings is not None else "bf16 base, no block swap"
    lines = [f"plan per GPU at {bucket} ({described}; {status}: docs/distributed.md):",
             *("  " + line for line in estimate.lines())]
    if layout.shard_degree > 1:  # the load's peak: each GPU's shards and one whole tensor, rank 0's host copy
        from wantrain.models.wan22.rank_plan import load_peak

        lines.append("  " + load_peak(cfg.model.variant, layout.shard_degree, _lora_rank(cfg)).line(
            layout.shard_degree, layout.expert_groups))
        from wantrain.models.wan22.rank_plan import save_gather  # each save's whole LoRA and AdamW state

        lines.append("  " + save_gather(cfg.model.variant, layout, _lora_rank(cfg)).line())
    return lines
