"""What ``wantrain check`` and ``wantrain cache`` do with a config (the CLI parses and prints): the pre-flight data
report, and filling the latent/text cache."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from wantrain.app.epochs import resolve_epochs
from wantrain.data import CacheStats, build_dataset, ensure_cache
from wantrain.data.report import PreflightReport, estimate_sampling_vram_gb
from wantrain.models.wan22 import build_adapter
from wantrain.models.wan22.lora_files import resolve_init
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.evaluation.config import sample_size


def dataset(cfg: Any) -> Any:
    """The run's training data as ``prepare()`` reads it (probes and plans; decodes nothing)."""
    return build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)


def resolved_config(cfg: Any) -> Any:
    """``cfg`` with its epoch keys as optimizer steps (the dataset is planned only when one is set)."""
    from wantrain.app.epochs import uses_epochs

    return resolve_epochs(cfg, dataset(cfg)) if uses_epochs(cfg) else cfg


def preflight_report(cfg: Any, *, verify: bool = False) -> PreflightReport:
    """The pre-flight data report of ``wantrain check`` (``verify``: decode every clip first), with the VRAM
    estimate of training and, with ``[sample]`` on, of sampling."""
    data = dataset(cfg)
    if verify:
        data.verify_all()
    cfg = resolve_epochs(cfg, data)  # the epoch keys as optimizer steps, into the report
    if cfg.lora.starts_from_files:  # rank and alpha of the lora.init_from* files (their headers; no model loads)
        lora, _ = resolve_init(cfg.lora, cfg.model)
        cfg = attrs.evolve(cfg, lora=lora)
    data.report.model_files = model_plan(cfg)
    data.set_vram_estimate(**memory_options(cfg))
    add_sampling_estimate(cfg, data.report)
    return data.report


def fill_cache(cfg: Any) -> tuple[CacheStats, PreflightReport]:
    """Encode what the cache lacks (``wantrain cache``), on the CPU; the stats and the data report."""
    data = dataset(cfg)
    encoders = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=torch.device("cpu"),
                             base_lr=cfg.optimizer.lr)
    return ensure_cache(data, encoders), data.report


def model_plan(cfg: Any) -> list[str]:
    """What the run will load from where (checked as the run checks it; a problem is reported as its one line)."""
    from wantrain.core.errors import UserError
    from wantrain.models.wan22.loading import WeightSource
    from wantrain.models.wan22.model_files import plan_lines

    try:
        source = WeightSource(cfg.model, cfg.run.seed)
    except UserError as exc:
        return [f"problem: {exc}"]
    return plan_lines(cfg.model, source.spec, random=source.random)


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
