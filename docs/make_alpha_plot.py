"""Draw docs/img/alpha_schedule_tiny.png from a short run of the tiny T2V model with an alpha schedule:
    PYTHONPATH=. python docs/make_alpha_plot.py
(about a minute on 2 CPU cores; the run goes to a temporary folder)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from wantrain.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[run]
output_dir = "runs"
name = "alpha_demo"
[model]
variant = "tiny-t2v"
switch_every = 10
gradient_checkpointing = false
[lora]
rank = 8
[lora.alpha_schedule]
enabled = true
preset = "video"
window = 40
min_samples = 30
[[lora.alpha_schedule.phases]]
name = "foundation"
alpha = 4
min_steps = 20
loss_improvement_rate_below = 1.0
[[lora.alpha_schedule.phases]]
name = "balance"
alpha = 7
min_steps = 20
loss_improvement_rate_below = 1.0
[[lora.alpha_schedule.phases]]
name = "emphasis"
alpha = 10
[data]
path = "demo_data"
[train]
max_steps = 200
log_every = 5
[optimizer]
lr = 2e-3
[observers]
progress = false
tensorboard = false
"""


def main_plot(out: Path = ROOT / "docs" / "img" / "alpha_schedule_tiny.png") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                        ignore=shutil.ignore_patterns(".wantrain_cache"))
        (tmp / "run.toml").write_text(CONFIG, encoding="utf-8")
        assert main(["run", str(tmp / "run.toml")]) == 0
        (run_dir,) = (tmp / "runs").iterdir()
        lines = [json.loads(x) for x in (run_dir / "alpha_metrics.jsonl").read_text().splitlines()]
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    for expert, color in (("high_noise", "tab:red"), ("low_noise", "tab:blue")):
        rows = [r for r in lines if r["expert"] == expert]
        steps = [r["step"] for r in rows]
        rate = [r["loss_improvement_rate"] for r in rows]
        se = [r["loss_improvement_rate_se"] or 0.0 for r in rows]
        axes[0].plot(steps, [r["linear_alpha"] for r in rows], drawstyle="steps-post", color=color, label=expert)
        axes[1].plot(steps, rate, ".-", color=color)
        axes[1].fill_between(steps, [a - b for a, b in zip(rate, se)], [a + b for a, b in zip(rate, se)],
                             color=color, alpha=0.15, lw=0)
        looks = [r for r in rows if r["look"] is not None]
        axes[1].plot([r["step"] for r in looks], [r["plateau_bound"] for r in looks], "v", color=color, ms=7,
                     label=f"{expert}: upper bound at a look")
        axes[2].plot(steps, [r["loss_cv"] for r in rows], ".-", color=color)
        axes[3].plot(steps, [r["gradient_stability"] for r in rows], ".-", color=color)
    axes[1].axhline(1.0, color="gray", ls="--", lw=0.8)
    axes[1].axhline(0.0, color="black", lw=0.5)
    axes[1].legend(fontsize=7)
    axes[3].axhline(0.5, color="gray", ls="--", lw=0.8)
    for ax, title in zip(axes, ("alpha in force (linear_alpha)", "improvement rate ± se (per 100 steps)",
                                "loss_cv", "gradient_stability"), strict=True):
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle("tiny-t2v, alpha schedule 4 -> 7 -> 10 (preserve_output), window 40; dashed: delta 1.0 and "
                 "stability 0.5;\na phase ends at a look whose upper bound is below delta", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    main_plot()
