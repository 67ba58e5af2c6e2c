"""The alpha what-if table of ``wantrain replay --observers alpha --set lora.alpha_schedule...`` (docs/replay.md):
the recorded transitions beside the replayed ones, per expert."""

from __future__ import annotations

import math
from typing import Any

from wantrain.observers.alpha.controller import AlphaChanged, expert_key


def alpha_whatif(result: Any) -> str:
    """Per expert, the recorded ``AlphaChanged`` transitions beside the replayed ones: step, phase change and the
    statistics at that step. ``result``: a ``wantrain.app.replay.ReplayResult`` (its ``recorded``, ``replayed`` and
    ``observers``). Empty when the alpha controller was not replayed."""
    recorded = [e for e in result.recorded if isinstance(e, AlphaChanged)]
    replayed = [e for e in result.replayed if isinstance(e, AlphaChanged)]
    if "AlphaController" not in result.observers:
        return ""
    experts = list(dict.fromkeys(expert_key(e.expert) for e in [*recorded, *replayed]))
    lines = ["alpha transitions: recorded | replayed" + (" (identical)" if recorded == replayed else "")]
    lines.append("  statistics at that step: slope = loss_slope, r2 = loss_r2, cv = loss_cv, rate = "
                 "loss_improvement_rate, n = loss_samples, stab = gradient_stability")
    if not experts:
        lines.append("  none recorded, none replayed")
    for k in experts:
        rec = [e for e in recorded if expert_key(e.expert) == k]
        rep = [e for e in replayed if expert_key(e.expert) == k]
        lines.append(f"  {k}:")
        rows = []
        for i in range(max(len(rec), len(rep))):
            rows.append((_transition(rec[i]) if i < len(rec) else "-", _transition(rep[i]) if i < len(rep) else "-"))
            rows.append(("  " + _stats(rec[i]) if i < len(rec) else "", "  " + _stats(rep[i]) if i < len(rep) else ""))
        width = max((len(a) for a, _ in rows), default=0)
        lines.extend(f"    {a:<{width}} | {b}" for a, b in rows)
    return "\n".join(lines)


def _transition(event: Any) -> str:
    return f"step {event.step:>6}  {event.from_phase} -> {event.to_phase} (alpha {event.to_alpha:g})"


_SHORT = {"loss_slope": "slope", "loss_r2": "r2", "loss_cv": "cv", "loss_improvement_rate": "rate",
          "loss_samples": "n", "gradient_stability": "stab"}


def _stats(event: Any) -> str:
    parts = []
    for name, short in _SHORT.items():
        value = event.statistics.get(name, math.nan)
        parts.append(f"{short} {value:.3g}")
    return " ".join(parts)
