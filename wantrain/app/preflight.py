"""What ``wantrain check`` and ``wantrain cache`` do with a config (the CLI parses and prints): the pre-flight data
report, and filling the latent/text cache."""

from __future__ import annotations

from typing import Any

from wantrain.data import CacheStats, build_dataset, ensure_cache
from wantrain.data.report import PreflightReport, estimate_sampling_vram_gb
from wantrain.models.wan22 import build_encoders
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
    return data.report


def fill_cache(cfg: Any) -> tuple[CacheStats, PreflightReport]:
    """Encode what the cache lacks (``wantrain cache``) with the VAE and the text encoder alone, on the training
    device (no transformer is loaded: caching needs none); the stats and the data report."""
    from wantrain.app.assemble import resolve_device

    data = dataset(cfg)
    encoders = build_encoders(cfg.model, cfg.lora, seed=cfg.run.seed, device=resolve_device(cfg.train.device))
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
