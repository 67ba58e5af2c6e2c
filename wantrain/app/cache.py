"""What ``wantrain cache`` does with a config (the CLI parses and prints): fill the latent/text cache with the VAE
and the text encoder alone, or describe and remove its entries."""

from __future__ import annotations

from typing import Any

from wantrain.app.device_plan import resolve_device
from wantrain.app.preflight import dataset
from wantrain.data import CacheStats, ensure_cache
from wantrain.data.cache import describe_entries, remove_entries
from wantrain.data.report import PreflightReport

__all__ = ["describe_entries", "fill_cache", "remove_entries"]


def fill_cache(cfg: Any) -> tuple[CacheStats, PreflightReport]:
    """Encode what the cache lacks (``wantrain cache``) with the VAE and the text encoder alone, on the training
    device (no transformer is loaded: caching needs none); the stats (with the entries this config does not
    use, left in place) and the data report."""
    from wantrain.models.wan22 import build_encoders  # the plug-in as loaded when the command runs

    data = dataset(cfg)
    encoders = build_encoders(cfg.model, cfg.lora, seed=cfg.run.seed, device=resolve_device(cfg.train.device))
    return ensure_cache(data, encoders, remove_orphans=False), data.report
