"""Regenerate the picture and the memory table of docs/optimizers.md: ``python docs/make_optimizer_plots.py``.

Loss curves: the quickstart (tiny random Wan T2V model, demo clips, CPU) trained for ``STEPS`` optimizer steps with
each optimizer type, everything else as in examples/quickstart.toml. Memory: optimizer state bytes per trained
parameter, measured after one step over a rank-16 LoRA pair of a 5120-wide layer (the A14B models' width).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import wantrain
from wantrain.optimizers import OptimizerConfig, build_optimizer

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
STEPS = 120
LR = {"adamw": 2e-3, "adamw8bit": 2e-3, "prodigy": 1.0, "adafactor": 2e-3, "adamw_schedulefree": 2e-3}


def loss_curves(work: Path) -> dict[str, tuple[list[int], list[float]]]:
    shutil.copytree(ROOT / "examples" / "demo_data", work / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    config = work / "quickstart.toml"
    config.write_text((ROOT / "examples" / "quickstart.toml").read_text().replace('"../runs"', '"runs"'))
    curves = {}
    for kind, lr in LR.items():
        outcome = wantrain.train(config, overrides=[
            f"train.max_steps={STEPS}", "train.device='cpu'", f"optimizer.type='{kind}'", f"optimizer.lr={lr}",
            f"run.run_id='{kind}'", "observers.progress=false", "observers.tensorboard=false",
            "checkpoint.enabled=false", f"train.save_every={STEPS}",
        ])
        rows = [json.loads(x) for x in (outcome.run_dir / "metrics.jsonl").read_text().splitlines()]
        curves[kind] = ([r["step"] for r in rows], [r["train/loss"] for r in rows])
        print(kind, "first/last loss", curves[kind][1][0], curves[kind][1][-1], file=sys.stderr)
    return curves


def state_bytes_per_parameter() -> dict[str, float]:
    out = {}
    for kind in LR:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, 5120) * 0.01), torch.nn.Parameter(torch.randn(5120, 16) * 0.01)]
        opt = build_optimizer(OptimizerConfig(type=kind), [{"params": params, "lr": 1e-4, "name": "lora"}],
                              torch.device("cpu"))
        if callable(getattr(opt, "train", None)):
            opt.train()
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        total = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        out[kind] = total / sum(p.numel() for p in params)
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        curves = loss_curves(Path(tmp))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=f"{kind} (lr {LR[kind]:g})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train/loss (mean over 5 steps)")
    ax.set_title(f"Quickstart (tiny T2V, CPU), {STEPS} steps, cosine schedule")
    ax.legend()
    fig.tight_layout()
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / "optimizer_losses.png", dpi=100)
    for kind, b in state_bytes_per_parameter().items():
        print(f"| `{kind}` | {b:.2f} |")


if __name__ == "__main__":
    main()
