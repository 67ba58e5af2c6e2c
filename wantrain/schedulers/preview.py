"""Preview of a schedule: the LR of every optimizer step for each parameter group, its key points, and a plot.

The LRs come from the real scheduler (:func:`build_scheduler` on a throwaway optimizer with one empty
parameter per group), so the preview is what training will use, external classes included.
"""

from __future__ import annotations

from pathlib import Path

from wantrain.schedulers import build_scheduler
from wantrain.schedulers.closed_form import cycle_limit_step, restart_steps
from wantrain.schedulers.config import TYPE_KEYS, SchedulerConfig, warmup_steps_for

_MAX_MARKED_RESTARTS = 60  # beyond this, restart lines would hide the curve


def sample(cfg: SchedulerConfig, base_lrs: dict[str, float], total_steps: int) -> dict[str, list[float]]:
    """LR of steps ``0 .. total_steps-1`` for each named group."""
    import torch

    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr, "name": name} for name, lr in base_lrs.items()]
    optimizer = torch.optim.SGD(groups, lr=next(iter(base_lrs.values())))
    scheduler = build_scheduler(cfg, optimizer, total_steps=total_steps)
    out: dict[str, list[float]] = {name: [] for name in base_lrs}
    for step in range(total_steps):
        if step:
            optimizer.step()  # no gradients: a no-op that keeps torch's step-order check satisfied
            scheduler.step()
        for name, lr in zip(base_lrs, scheduler.get_last_lr(), strict=True):
            out[name].append(lr)
    return out


def key_points(cfg: SchedulerConfig, lrs: dict[str, list[float]], total_steps: int) -> list[tuple[int, str]]:
    """``(step, label)`` of the first step, the end of warmup, each restart, the cycle limit and the last step.

    For external classes, whose structure is unknown, every step where the LR rises is listed instead of restarts.
    """
    points: list[tuple[int, str]] = [(0, "first step")]
    if cfg.type != "external":
        warmup = warmup_steps_for(cfg, total_steps)
        if warmup:
            points.append((warmup, "end of warmup (first step of the schedule)"))
        gamma = cfg.get("gamma")
        for step, k in restart_steps(cfg, total_steps):
            points.append((step, f"restart {k} (peak = base * {gamma:g}**{k})"))
        limit_step = cycle_limit_step(cfg, total_steps)
        if limit_step is not None:
            points.append((limit_step, "cycle_limit reached: LR stays at the floor"))
    else:
        series = list(lrs.values())
        for step in range(1, total_steps):
            if any(s[step] > s[step - 1] for s in series):
                points.append((step, "LR rises"))
    if total_steps > 1:
        points.append((total_steps - 1, "last step"))
    return sorted(set(points))


def format_table(cfg: SchedulerConfig, lrs: dict[str, list[float]], points: list[tuple[int, str]],
                 total_steps: int, *, max_rows: int = 40) -> str:
    """The key points as a table, each step numbered as the progress line, ``metrics.jsonl`` and the checkpoints
    number it: the first optimizer step is step 1 (``points`` and ``lrs`` count from 0, the steps taken before)."""
    names = list(lrs)
    lines = [f"lr_scheduler: {describe(cfg)} over {total_steps} optimizer steps; groups: {', '.join(names)}"]
    lines.append(f"{'step':>8}  " + "  ".join(f"{n:>12}" for n in names) + "  point")
    shown = points if len(points) <= max_rows else points[: max_rows - 1] + points[-1:]
    for i, (step, label) in enumerate(shown):
        if len(points) > max_rows and i == max_rows - 1:
            lines.append(f"{'...':>8}  ({len(points) - max_rows} more points)")
        lines.append(f"{step + 1:>8}  " + "  ".join(f"{lrs[n][step]:>12.4e}" for n in names) + f"  {label}")
    return "\n".join(lines)


def describe(cfg: SchedulerConfig) -> str:
    """One line naming the schedule and the keys that were set, e.g. ``cosine (warmup_steps=100, eta_min=1e-06)``."""
    if cfg.type == "external":
        args = cfg.external_arguments()
        return f"{cfg.class_path}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
    keys = ("warmup_steps", "warmup_start_factor", *TYPE_KEYS[cfg.type])
    shown = [f"{k}={getattr(cfg, k)!r}" for k in keys if getattr(cfg, k) not in (None, 0)]
    return cfg.type + (f" ({', '.join(shown)})" if shown else "")


def plot(cfg: SchedulerConfig, lrs: dict[str, list[float]], total_steps: int, out: Path, *, title: str | None = None
         ) -> Path:
    """Write a PNG of the LR of each group over the run; warmup shaded, restarts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    steps = range(1, total_steps + 1)  # numbered as training numbers them (format_table)
    styles = ("-", "--", "-.", ":")  # equal curves (same base LR) stay visible on top of each other
    for i, (name, series) in enumerate(lrs.items()):
        ax.plot(steps, series, label=name, linewidth=1.4, linestyle=styles[i % len(styles)], drawstyle="steps-post")
    if cfg.type != "external":
        warmup = warmup_steps_for(cfg, total_steps)
        if warmup:
            ax.axvspan(1, warmup + 1, color="tab:orange", alpha=0.12, label=f"warmup ({warmup} steps)")
        restarts = restart_steps(cfg, total_steps)
        if restarts and len(restarts) <= _MAX_MARKED_RESTARTS:
            for i, (step, _) in enumerate(restarts):
                ax.axvline(step + 1, color="grey", linestyle=":", linewidth=0.8, label="restart" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_xlim(1, max(2, total_steps))
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.set_title(title or describe(cfg), fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
