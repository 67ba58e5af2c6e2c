"""What ``wantrain check`` and ``wantrain cache`` do with a config (the CLI parses and prints): the pre-flight data
report, and filling the latent/text cache."""

from __future__ import annotations

from typing import Any

import torch

from wantrain.data import CacheStats, build_dataset, ensure_cache
from wantrain.data.report import PreflightReport, estimate_sampling_vram_gb
from wantrain.models.wan22 import build_adapter
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.evaluation.config import sample_size


def dataset(cfg: Any) -> Any:
    """The run's training data as ``prepare()`` reads it (probes and plans; decodes nothing)."""
    return build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)


def preflight_report(cfg: Any, *, verify: bool = False) -> PreflightReport:
    """The pre-flight data report of ``wantrain check`` (``verify``: decode every clip first), with the VRAM
    estimate of training and, with ``[sample]`` on, of sampling."""
    data = dataset(cfg)
    if verify:
        data.verify_all()
    data.set_vram_estimate(**memory_options(cfg))
    add_sampling_estimate(cfg, data.report)
    plan_memory(cfg, data)
    return data.report


def fill_cache(cfg: Any) -> tuple[CacheStats, PreflightReport]:
    """Encode what the cache lacks (``wantrain cache``), on the CPU; the stats and the data report."""
    data = dataset(cfg)
    encoders = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=torch.device("cpu"),
                             base_lr=cfg.optimizer.lr)
    return ensure_cache(data, encoders), data.report


def memory_options(cfg) -> dict:
    """Memory options of the run that the VRAM estimate uses (keys the model section may or may not have yet)."""
    model, train = cfg.model, cfg.train
    dtype = getattr(model, "base_dtype", None) or getattr(model, "dtype", None) or "bf16"
    gc = getattr(model, "gradient_checkpointing", getattr(train, "gradient_checkpointing", True))
    return {"rank": cfg.lora.rank, "base_dtype": str(dtype), "gradient_checkpointing": bool(gc)}


def add_sampling_estimate(cfg, report) -> None:
    """With ``[sample]`` enabled, add the sampling footprint to the report's VRAM estimate."""
    if not cfg.sample.enabled or not report.vram:
        return
    spec = variant_spec(cfg.model.variant)
    width, height, frames = sample_size(cfg.sample, spec)
    options = memory_options(cfg)
    gb = estimate_sampling_vram_gb(spec, width, height, frames, options["rank"], options["base_dtype"])
    report.vram.update(sampling_gb=round(gb, 2), sampling_size=f"{width}x{height}x{frames}")


def plan_memory(cfg: Any, data: Any) -> Any:
    """The ``[model]`` section the run trains with: with ``model.vram_budget_gb`` the planner's choice of
    ``base_dtype`` (when ``auto``), ``blocks_to_swap`` and ``offload_activations`` for the largest bucket, else the
    section as it is. The estimate, part by part, goes into ``data.report.memory_plan`` (``wantrain check`` prints
    it). A budget nothing fits is a one-line ``UserError`` naming the smallest setting and what would fit."""
    import attrs

    from wantrain.core.errors import UserError
    from wantrain.models.wan22.memory import MemorySettings, estimate, plan

    model = cfg.model
    buckets = data.report.buckets
    if not buckets:
        return model
    spec = variant_spec(model.variant)
    b = max(buckets, key=lambda r: (r.width * r.height * r.frames, r.frames))
    size = dict(width=b.width, height=b.height, frames=b.frames, rank=cfg.lora.rank, batch=cfg.train.batch_size)
    dtype = model.base_dtype
    if dtype == "auto" and spec.tiny:
        dtype = "fp32"
    if model.vram_budget_gb is None:
        settings = MemorySettings("bf16" if dtype == "auto" else dtype, model.blocks_to_swap, model.offload_activations)
        chosen = estimate(model.variant, settings, **size,
                          gradient_checkpointing=model.gradient_checkpointing)
    else:
        chosen, smallest = plan(model.variant, model.vram_budget_gb, base_dtype=dtype, **size)
        if chosen is None:
            raise UserError(
                f"model.vram_budget_gb = {model.vram_budget_gb:g}: nothing fits the largest bucket "
                f"{b.width}x{b.height}x{b.frames} (the smallest setting, {smallest.settings.describe()}, needs "
                f"{smallest.device_gib:.1f} GiB); {_what_fits(model.variant, model.vram_budget_gb, dtype, size)}"
            )
        model = attrs.evolve(model, vram_budget_gb=None, blocks_to_swap=chosen.settings.blocks_to_swap,
                             offload_activations=chosen.settings.offload_activations,
                             base_dtype=model.base_dtype if dtype != "auto" else chosen.settings.base_dtype)
    data.report.memory_plan = {"budget_gib": cfg.model.vram_budget_gb, "bucket": f"{b.width}x{b.height}x{b.frames}",
                               "lines": chosen.lines(), **chosen.to_json()}
    return model


def _what_fits(variant: str, budget: float, dtype: str, size: dict) -> str:
    """What would fit ``budget``: fewer frames or a lower resolution (same aspect) with the smallest setting."""
    from wantrain.models.wan22.memory import plan

    width, height, frames = size["width"], size["height"], size["frames"]
    for f in range(frames - 4, 0, -4):
        if plan(variant, budget, base_dtype=dtype, **{**size, "frames": f})[0] is not None:
            return f"{f} frames at {width}x{height} would fit, or a budget of {_smallest_budget(variant, dtype, size)}"
    return f"a budget of {_smallest_budget(variant, dtype, size)} would fit"


def _smallest_budget(variant: str, dtype: str, size: dict) -> str:
    from wantrain.models.wan22.memory import plan

    _, smallest = plan(variant, 0.0, base_dtype=dtype, **size)
    return f"{smallest.device_gib:.1f} GiB"
