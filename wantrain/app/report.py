"""What ``wantrain report RUN_DIR`` draws and prints (``wantrain.cli.report``): one PNG dashboard and a short text
summary of a run.

Reads ``RUN_DIR/metrics.jsonl`` (written by :class:`wantrain.observers.jsonl_metrics.JsonlMetrics`; schema in
``docs/metrics.md``). The dashboard has six panels, always in this order and with these titles
(:data:`PANEL_TITLES`): loss per expert (raw and EMA), learning rate per parameter group, gradient norm, parameter
norm, memory, and speed (optimizer steps per second between log lines, from ``elapsed_s``). Where the file has an
``alpha/phase`` field, each phase is shaded on every panel, and the alpha in force per expert
(``alpha/linear_alpha/<k>``) is drawn as a step line on the loss panel's right-hand axis. ``val/loss`` (and
``val/loss/<expert>``) of the validation observer are drawn dashed with markers on the loss panel; lines that hold
only ``val/*`` values are left out of the other curves. A panel without data says so instead of vanishing, so
the layout is the same for every run.

Each expert's loss average (EMA) is one line over that expert's own log lines, drawn across the other expert's
stints: with ``train.log_every`` equal to ``model.switch_every`` every log line holds one expert, and a line that
broke wherever the expert was absent would have no two neighbouring points to draw. The raw points keep their gaps.
The memory axis starts at 0: a few MB of change on several GiB is a flat line, not a cliff.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wantrain.app.keep import pick_step
from wantrain.core.errors import UserError
from wantrain.observers.jsonl_metrics import read_metrics
from wantrain.observers.progress import format_duration

METRICS_FILE = "metrics.jsonl"
PANEL_TITLES = ("Loss", "Learning rate", "Gradient norm", "Parameter norm", "Memory (GiB)", "Speed (steps/s)")
EMA_BETA = 0.9
_PHASE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


# -- input ---------------------------------------------------------------------------------------------------
def load_records(run_dir: Path) -> tuple[Path, list[dict[str, Any]]]:
    """The metrics file of ``run_dir`` and its records sorted by step. Raises :class:`UserError` (one line) when
    the directory or the file is missing or holds no complete line."""
    run_dir = Path(run_dir)
    path = run_dir if run_dir.is_file() else run_dir / METRICS_FILE
    if not run_dir.exists():
        raise UserError(f"run directory not found: {run_dir}")
    if not path.is_file():
        raise UserError(f"no {METRICS_FILE} in {run_dir} (it is written by the JSONL metrics observer during "
                        "training); pass a run directory of a run that logged at least one step")
    records = read_metrics(path)
    if not records:
        raise UserError(f"{path} holds no metrics lines yet; run at least train.log_every steps first")
    return path, sorted(records, key=lambda r: r["step"])


def series(records: Sequence[dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``field`` over the lines that have it (null -> NaN, a gap in the plot)."""
    steps, values = [], []
    for r in records:
        if field in r:
            steps.append(r["step"])
            values.append(float("nan") if r[field] is None else float(r[field]))
    return steps, values


def with_gaps(records: Sequence[dict[str, Any]], field: str, values: Sequence[float] | None = None,
              ) -> tuple[list[int], list[float]]:
    """Every line's step, with ``field``'s value (or the matching entry of ``values``, one per line that has the
    field) and NaN where the line lacks it: a plotted line breaks where an expert was not trained."""
    present = iter(values if values is not None else series(records, field)[1])
    steps, out = [], []
    for r in records:
        steps.append(r["step"])
        out.append(next(present) if field in r else float("nan"))
    return steps, out


def ema(values: Sequence[float], beta: float = EMA_BETA) -> list[float]:
    """Exponential moving average, seeded with the first finite value; NaNs are carried over, not averaged."""
    out, avg = [], None
    for v in values:
        if math.isfinite(v):
            avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg if avg is not None else float("nan"))
    return out


def _fields(records: Sequence[dict[str, Any]], prefix: str) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k in r:
            if k.startswith(prefix):
                seen[k] = None
    return sorted(seen)


def loss_fields(records: Sequence[dict[str, Any]]) -> list[str]:
    """Per-expert loss fields when the run had experts, else ``train/loss``."""
    per_expert = _fields(records, "train/loss/")
    return per_expert or (["train/loss"] if _fields(records, "train/loss") else [])


def phase_spans(records: Sequence[dict[str, Any]]) -> list[tuple[float, int, int]]:
    """``(phase, first_step, last_step)`` runs of equal ``alpha/phase`` values, in step order."""
    spans: list[tuple[float, int, int]] = []
    for step, phase in zip(*series(records, "alpha/phase"), strict=True):
        if not math.isfinite(phase):
            continue
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], step)
        else:
            spans.append((phase, step, step))
    return spans


# -- figure --------------------------------------------------------------------------------------------------
def build_report(records: Sequence[dict[str, Any]], title: str = ""):
    """The dashboard as a matplotlib ``Figure`` (no pyplot state); :func:`panel_titles` lists its panels."""
    from matplotlib.figure import Figure

    every = records
    records = [r for r in records if not is_validation_only(r)]  # val/ lines of their own would break the curves
    fig = Figure(figsize=(14, 11), layout="constrained")
    axes = fig.subplots(3, 2, sharex=True).ravel()
    for ax, name in zip(axes, PANEL_TITLES, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
    _plot_loss(axes[0], records)
    _plot_validation(axes[0], every)
    lr_fields = _fields(records, "train/lr/") or _fields(records, "train/lr")
    _plot_lines(axes[1], records, lr_fields, log=True)
    _plot_lines(axes[2], records, ["train/grad_norm", *_fields(records, "train/grad_norm/")], log=True)
    _plot_lines(axes[3], records, ["train/total_param_norm", *_fields(records, "train/param_norm/")])
    _plot_lines(axes[4], records, _fields(records, "memory/"))
    _from_zero(axes[4])
    _plot_speed(axes[5], records)
    spans = phase_spans(records)
    for ax in axes:
        _shade_phases(ax, spans, label=ax is axes[0])
        if ax.get_legend_handles_labels()[0] and ax is not axes[0]:
            ax.legend(fontsize="small", loc="best")
    _loss_legend(axes[0], _plot_alpha(axes[0], records))
    for ax in axes[-2:]:
        ax.set_xlabel("optimizer step")
    if title:
        fig.suptitle(title)
    return fig


def panel_titles(fig) -> list[str]:
    """Titles of the figure's panels, in layout order (the loss panel's alpha axis is no panel of its own)."""
    return [ax.get_title() for ax in fig.axes if ax.get_label() != ALPHA_AXIS]


ALPHA_AXIS = "alpha"
"""The label of the loss panel's right-hand axis (``alpha/linear_alpha/<k>``)."""


def alpha_axis(fig):
    """The loss panel's alpha axis, or None when the run had no alpha schedule."""
    return next((ax for ax in fig.axes if ax.get_label() == ALPHA_AXIS), None)


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_loss(ax, records) -> None:
    fields = loss_fields(records)
    if not fields:
        return _no_data(ax)
    for i, field in enumerate(fields):
        values = series(records, field)[1]
        color = f"C{i}"
        name = field.removeprefix("train/loss/") if field != "train/loss" else "loss"
        ax.plot(*with_gaps(records, field), color=color, alpha=0.35, linewidth=0.8, marker=".", markersize=2,
                label=f"{name} (raw)")
        steps = series(records, field)[0]  # the expert's own lines: the average runs across the other's stints
        ax.plot(steps, ema(values), color=color, linewidth=1.8, label=f"{name} (EMA {EMA_BETA})")


def is_validation_only(record: dict[str, Any]) -> bool:
    """A line that holds only evaluation metrics, ``val/*`` or ``samples/*`` (a validation or a sampling round at
    step 0 or between log steps, docs/metrics.md)."""
    return (any(k.startswith(("val/", "samples/")) for k in record)
            and not any(k.startswith("train/") for k in record))


def _plot_validation(ax, records) -> None:
    """``val/loss`` (and per expert) as dashed lines with markers over the training loss."""
    fields = ["val/loss", *_fields(records, "val/loss/high_noise"), *_fields(records, "val/loss/low_noise")]
    for i, field in enumerate(f for f in fields if series(records, f)[0]):
        ax.plot(*series(records, field), color="black" if i == 0 else f"C{i + 3}", linestyle="--", marker="o",
                markersize=3, linewidth=1.2, label=field)


def _plot_lines(ax, records, fields: Sequence[str], log: bool = False) -> None:
    drawn = False
    for field in fields:
        if series(records, field)[0]:
            ax.plot(*with_gaps(records, field), linewidth=1.2, marker=".", markersize=2, label=field)
            drawn = True
    if not drawn:
        return _no_data(ax)
    if log and all(v > 0 for f in fields for v in series(records, f)[1] if math.isfinite(v)):
        ax.set_yscale("log")


def _from_zero(ax) -> None:
    """Start the axis at 0 (values are sizes) and end it 15 % above the largest value: a flat series (memory
    usually is) would otherwise sit on the top edge, where matplotlib's autoscale leaves it, hidden by the frame."""
    values = [v for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)]
    if values:
        ax.set_ylim(bottom=0, top=max(max(values) * 1.15, 1e-9))


def _plot_alpha(ax, records) -> None:
    """The alpha in force per expert (``alpha/linear_alpha/<k>``), as steps on a right-hand axis of ``ax``."""
    fields = _fields(records, "alpha/linear_alpha/")
    if not any(series(records, f)[0] for f in fields):
        return
    twin = ax.twinx()
    twin.set_label(ALPHA_AXIS)
    twin.set_ylabel("alpha")
    for i, field in enumerate(fields):
        steps, values = series(records, field)
        if steps:
            twin.plot(steps, values, drawstyle="steps-post", linestyle=":", linewidth=1.6, color=f"C{i + 6}",
                      label=f"alpha {field.removeprefix('alpha/linear_alpha/')}")
    twin.set_ylim(bottom=0)
    return twin


def _loss_legend(ax, twin) -> None:
    """One legend for the loss panel, its alpha axis included, outside the plot on the right: the panel has the
    most entries (raw and EMA per expert, validation, phases, alpha per expert), and two legends inside it
    covered each other and the curves."""
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        (twin or ax).legend(handles, labels, fontsize="small", loc="upper left", borderaxespad=0,
                            bbox_to_anchor=(1.1 if twin is not None else 1.02, 1.0))


def _plot_speed(ax, records) -> None:
    steps, rates = [], []
    previous = None
    for r in records:
        if not isinstance(r.get("elapsed_s"), int | float):
            continue
        if previous is not None and r["step"] > previous["step"] and r["elapsed_s"] > previous["elapsed_s"]:
            steps.append(r["step"])
            rates.append((r["step"] - previous["step"]) / (r["elapsed_s"] - previous["elapsed_s"]))
        previous = r
    if not steps:
        return _no_data(ax)
    ax.plot(steps, rates, linewidth=1.2, label="steps/s")


def _shade_phases(ax, spans, label: bool) -> None:
    for i, (phase, first, last) in enumerate(spans):
        # a phase covers from its first logged step to the next phase's first step
        end = spans[i + 1][1] if i + 1 < len(spans) else last
        name = int(phase) if phase == int(phase) else phase
        ax.axvspan(first, end, color=_PHASE_COLORS[i % len(_PHASE_COLORS)], alpha=0.08,
                   label=f"alpha phase {name}" if label else None)


# -- text summary --------------------------------------------------------------------------------------------
def summarize(records: Sequence[dict[str, Any]], run_dir: Path | None = None) -> str:
    """A few lines: steps, wall time, best/last loss per expert, skipped steps, peak VRAM when known, the samples'
    motion, and the step to keep (``wantrain.app.keep``; with ``run_dir``, among the steps with LoRA files)."""
    last = records[-1]
    lines = [f"steps: {last['step']} (first logged {records[0]['step']}, {len(records)} log lines)"]
    elapsed = last.get("elapsed_s")
    if isinstance(elapsed, int | float):
        lines.append(f"time: {format_duration(elapsed)} ({elapsed:.1f} s)")
    for field in loss_fields(records):
        steps, values = series(records, field)
        finite = [(v, s) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
        name = field.removeprefix("train/loss/") if field != "train/loss" else "all"
        if not finite:
            lines.append(f"loss {name}: no finite values")
            continue
        best, best_step = min(finite)
        # 4 significant digits, as the progress line and the run page write a loss
        lines.append(f"loss {name}: best {best:.4g} at step {best_step}, last {values[-1]:.4g} at step {steps[-1]}")
    val_steps, val = series(records, "val/loss")
    if val_steps:
        lines.append(f"val/loss: {val[0]:.4g} at step {val_steps[0]}, last {val[-1]:.4g} at step {val_steps[-1]}")
    skipped = [v for v in series(records, "train/skipped_steps")[1] if math.isfinite(v)]
    lines.append(f"skipped steps: {int(skipped[-1]) if skipped else 0}")
    peak = [v for v in series(records, "memory/vram_peak_gb")[1] if math.isfinite(v)]
    if peak:
        lines.append(f"peak VRAM: {max(peak):.2f} GiB")
    moved = [(r["step"], r["samples/motion"], r.get("samples/motion_ratio")) for r in records
             if isinstance(r.get("samples/motion"), int | float)]
    if moved:
        lines.append("samples/motion (pixels/frame; ratio to the training clips): " + ", ".join(
            f"step {s} {m:.3g}" + (f" ({q:.2f}x)" if isinstance(q, int | float) else "") for s, m, q in moved))
    pick = pick_step(records, run_dir)
    if pick is not None:
        lines.extend(pick.lines())
    elif moved or any(k.startswith("val/loss") for r in records for k in r):
        lines.append("keep: no step with saved LoRA files has a validation loss or a motion ratio; save where you "
                     "validate (train.save_every a multiple of validation.every)")
    else:
        lines.append("keep: no validation loss or motion ratio to choose a step by ([validation] / [sample])")
    return "\n".join(lines)
