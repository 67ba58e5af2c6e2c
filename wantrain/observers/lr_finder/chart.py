"""The LR finder's chart: loss against LR on a log axis, one panel per expert.

Drawn: the raw rung losses (dots), the bias-corrected EMA, the running median (what the suggestions read), the
default suggestion's 90 % bootstrap band (shaded), one marker per suggestion method with its LR in the legend, the
default starred. The y range
leaves out the diverged tail so that the descent stays readable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from wantrain.observers.lr_finder.math import LABELS

MARKERS = {"valley": ("o", "tab:green"), "steepest": ("s", "tab:red"), "minimum": ("^", "tab:purple")}


def chart_figure(sweeps: Sequence[Any], cfg: Any) -> Any:
    """A matplotlib ``Figure`` of ``sweeps`` (``lr_finder._Sweep`` objects with rows and a result)."""
    from matplotlib.figure import Figure  # not pyplot: no global figure registry, no GUI backend

    fig = Figure(figsize=(7.0, 3.6 * max(1, len(sweeps))), layout="constrained")
    for i, sweep in enumerate(sweeps):
        ax = fig.add_subplot(len(sweeps), 1, i + 1)
        result = sweep.result
        points = [(r["lr"], r["raw_loss"], r["smoothed_loss"]) for r in sweep.rows if math.isfinite(r["raw_loss"])]
        lrs = [p[0] for p in points]
        raw = [p[1] for p in points]
        # the curve the suggestions read (trimmed and clipped: lr_finder.math.suggestion_curve), by rung
        by_rung = list(result.curve) if result is not None and result.curve else []
        shown = [(r["lr"], c) for r, c in zip(sweep.rows, by_rung, strict=False) if c is not None]
        curve = [c for _, c in shown]
        ax.plot(lrs, raw, ".", color="0.6", markersize=4, label="raw loss")
        ax.plot(lrs, [p[2] for p in points], color="tab:blue", linewidth=1.2, label=f"EMA (beta {cfg.smoothing:g})")
        ax.plot([x for x, _ in shown], curve, "--", color="tab:orange", linewidth=1.2,
                label="running median (suggestions read this)")
        if result is not None and result.band is not None:
            lo, hi = result.band
            if result.default == "minimum":  # the band is of the LR / 10; shade it where the suggestion is read
                lo, hi = lo * 10, hi * 10
            ax.axvspan(lo, hi, color="tab:green", alpha=0.12, label=f"90 % band {result.band[0]:.3g}-"
                       f"{result.band[1]:.3g}")
        if result is not None:
            for method, index in result.indices.items():
                if index is None:
                    continue
                marker, color = MARKERS[method]
                star = method == result.default
                ax.plot(sweep.rows[index]["lr"], by_rung[index], marker="*" if star else marker,
                        color=color, markersize=14 if star else 8, linestyle="none",
                        label=f"{LABELS[method]}: {result.lrs[method]:.3g}" + (" (default)" if star else ""))
        ax.set_xscale("log" if cfg.mode == "exp" else "linear")
        if curve:
            low = min(raw)
            i_min = min(range(len(curve)), key=curve.__getitem__)
            top = max(curve[: i_min + 1])
            span = max(top - min(curve), 1e-12)
            ax.set_ylim(low - 0.05 * span, top + 0.6 * span)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        title = f"LR range test ({sweep.expert})" if sweep.expert else "LR range test"
        if sweep.stop_reason:
            title += " -- stopped early"
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return fig
