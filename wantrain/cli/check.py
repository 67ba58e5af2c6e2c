"""``wantrain check CONFIG``: the pre-flight data report (buckets, skipped files, waste, steps, VRAM estimate).

Probes and plans only (no decoding, no model) unless ``--verify`` asks for every clip to be decoded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wantrain.cli.common import add_config_arguments, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--verify", action="store_true",
                        help="decode every clip to verify frame counts (slow on large datasets)")


def memory_options(cfg) -> dict:
    """Memory options of the run that the VRAM estimate uses (keys the model section may or may not have yet)."""
    model, train = cfg.model, cfg.train
    dtype = getattr(model, "base_dtype", None) or getattr(model, "dtype", None) or "bf16"
    gc = getattr(model, "gradient_checkpointing", getattr(train, "gradient_checkpointing", True))
    return {"rank": cfg.lora.rank, "base_dtype": str(dtype), "gradient_checkpointing": bool(gc)}


def run(args: argparse.Namespace) -> int:
    from wantrain.data import build_dataset
    from wantrain.models.wan22.variants import variant_spec

    cfg = load_run_config(args)
    data = build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)
    if args.verify:
        data.verify_all()
    data.set_vram_estimate(**memory_options(cfg))
    add_sampling_estimate(cfg, data.report)
    print(data.report.format())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data.report.to_json(), indent=2) + "\n")
    return 0


def add_sampling_estimate(cfg, report) -> None:
    """With ``[sample]`` enabled, add the sampling footprint to the report's VRAM estimate."""
    from wantrain.data.report import estimate_sampling_vram_gb
    from wantrain.models.wan22.variants import variant_spec
    from wantrain.observers.evaluation.config import sample_size

    if not cfg.sample.enabled or not report.vram:
        return
    spec = variant_spec(cfg.model.variant)
    width, height, frames = sample_size(cfg.sample, spec)
    options = memory_options(cfg)
    gb = estimate_sampling_vram_gb(spec, width, height, frames, options["rank"], options["base_dtype"])
    report.vram.update(sampling_gb=round(gb, 2), sampling_size=f"{width}x{height}x{frames}")
