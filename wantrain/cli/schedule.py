"""``wantrain schedule CONFIG [--out lr_schedule.png]``: plot the learning rate over the configured run.

The run is ``train.max_steps`` optimizer steps. Parameter groups are those training will have: ``high_noise``
and ``low_noise`` for the two-expert variants, one ``lora`` group otherwise, each starting from
``optimizer.lr`` unless the model section sets a per-expert LR (``model.lr_high_noise`` / ``model.lr_low_noise``).
Prints the LR of each group at the key points (first step, end of warmup, each restart, last step).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wantrain.cli.common import add_config_arguments, load_run_config

DEFAULT_OUT = "lr_schedule.png"
_TWO_EXPERT_VARIANTS = ("t2v-a14b", "i2v-a14b", "tiny-t2v", "tiny-i2v")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), metavar="PNG",
        help=f"where to write the plot (default: {DEFAULT_OUT} in the current directory)",
    )


def group_base_lrs(cfg) -> dict[str, float]:  # cfg: wantrain.config.RunConfig
    """Name and base LR of each parameter group training will create for this config."""
    try:
        from wantrain.models.wan22.variants import variant_spec

        experts = [e for e in variant_spec(cfg.model.variant).experts if e]
    except (ImportError, KeyError):
        experts = ["high_noise", "low_noise"] if cfg.model.variant in _TWO_EXPERT_VARIANTS else []
    if len(experts) < 2:
        out = {"lora": cfg.optimizer.lr}
    else:
        out = {}
        for name in experts:
            lr = getattr(cfg.model, f"lr_{name}", None)
            out[name] = cfg.optimizer.lr if lr is None else lr
    ratio = getattr(getattr(cfg, "lora", None), "plus_lr_ratio", None)
    if ratio is not None:  # LoRA+: each group's B matrices at ratio x its LR, on the same curve
        out = {k: v for name, lr in out.items() for k, v in ((name, lr), (f"{name}_B", lr * ratio))}
    return out


def run(args: argparse.Namespace) -> int:
    from wantrain.app.preflight import resolved_config
    from wantrain.schedulers.preview import format_table, key_points, plot, sample

    cfg = resolved_config(load_run_config(args))  # train.max_epochs: the steps of the data plan
    total = cfg.train.max_steps
    sched = cfg.lr_scheduler
    lrs = sample(sched, group_base_lrs(cfg), total)
    print(format_table(sched, lrs, key_points(sched, lrs, total), total))
    out = plot(sched, lrs, total, args.out)
    print(f"wrote {out}")
    return 0
