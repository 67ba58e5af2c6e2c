"""``wantrain cache CONFIG``: encode and cache every clip's latents and every caption's text embeddings.

Loads the VAE and text encoder only if something is missing (the model adapter loads them on first use), and
removes cache entries no current clip or caption uses. ``wantrain run`` then trains from the cache.
"""

from __future__ import annotations

import argparse

from wantrain.cli.common import add_config_arguments, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from wantrain.data import build_dataset, ensure_cache
    from wantrain.models.wan22 import build_adapter
    from wantrain.models.wan22.variants import variant_spec

    cfg = load_run_config(args)
    data = build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)
    encoders = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=torch.device("cpu"),
                             base_lr=cfg.optimizer.lr)
    stats = ensure_cache(data, encoders)
    print(stats.format())
    if data.report.verification:
        print(f"{len(data.report.verification)} clips re-bucketed or skipped while decoding:")
        for v in data.report.verification:
            print(f"  {v['path']}: {v['action']} ({v['reason']})")
    return 0
