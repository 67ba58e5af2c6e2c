"""The LR finder's chart: loss against LR on a log axis, one panel per expert.

Drawn: the raw rung losses (dots), the bias-corrected EMA (what the stop rule reads), the centred curve (what the
suggestions read), one marker per suggestion method with its LR in the legend, the default starred. The y range
leaves out the diverged tail so that the descent stays readable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

LABELS = {"valley": "valley", "steepest": "steepest", "minimum": "minimum / 10"}
MARKERS = {"valley": ("o", "tab:green"), "steepest": ("s", "tab:red"), "minimum": ("^", "tab:purple")}


def chart_figure(sweeps: Sequence[Any], cfg: Any) -> Any:
    """A matplotlib ``Figure`` of ``sweeps`` (``lr_finder._Sweep`` objects with rows and a result)."""
    from matplotlib.figure import Figure  # not pyplot: no global figure registry, no GUI backend

    from wantrain.observers.lr_finder.math import centred

    fig = Figure(figsize=(7.0, 3.6 * max(1, len(sweeps))), layout="constrained")
    for i, sweep in enumerate(sweeps):
        ax = fig.add_subplot(len(sweeps), 1, i + 1)
        points = [(r["lr"], r["raw_loss"], r["smoothed_loss"]) for r in sweep.rows if math.isfinite(r["raw_loss"])]
        lrs = [p[0] for p in points]
        raw = [p[1] for p in points]
        curve = centred(raw, cfg.smoothing) if raw else []
        ax.plot(lrs, raw, ".", color="0.6", markersize=4, label="raw loss")
        ax.plot(lrs, [p[2] for p in points], color="tab:blue", linewidth=1.2, label=f"EMA (beta {cfg.smoothing:g})")
        ax.plot(lrs, curve, "--", color="tab:orange", linewidth=1.2, label="centred (suggestions read this)")
        result = sweep.result
        if result is not None:
            for method, index in result.indices.items():
                if index is None:
                    continue
                marker, color = MARKERS[method]
                star = method == result.default
                ax.plot(lrs[index], curve[index], marker="*" if star else marker,
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
