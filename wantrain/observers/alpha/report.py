"""What the alpha schedule reports outside a run: the what-if table of ``wantrain replay --observers alpha --set
lora.alpha_schedule...`` (docs/replay.md: the recorded transitions beside the replayed ones, per expert), and the
resolution lines of ``wantrain check`` (the smallest slope each phase's window resolves)."""

from __future__ import annotations

import math
from typing import Any

from wantrain.observers.alpha.controller import RISE_LEVEL, AlphaChanged, expert_key, look_level, t_quantile
from wantrain.observers.alpha.stats import BLOCKS


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


AUTOCORRELATION = 0.5
"""The lag-1 correlation of per-step video losses the presets and ``wantrain check`` assume (AR(1), ρ ≈ 0.5:
shared data order, momentum; issue 34). It triples the variance of a window's slope."""


def rate_standard_error(window: int, cv: float, rho: float = 0.0) -> float:
    """The standard error of a window's improvement rate (per 100 steps) for per-step losses of coefficient of
    variation ``cv`` with AR(1) correlation ``rho`` between consecutive steps: 100·cv·sqrt(12/(n³ - n)) (the
    least-squares slope's over its mean, independent steps) times sqrt((1+ρ)/(1-ρ)) (the long-run variance of an
    AR(1) series over its variance)."""
    return 100.0 * cv * math.sqrt(12.0 / (window ** 3 - window)) * math.sqrt((1 + rho) / (1 - rho))


def smallest_resolvable_rate(window: int, cv: float, rho: float = 0.0) -> float:
    """The smallest δ (per 100 steps) at which a flat loss with per-step CV ``cv`` and AR(1) correlation ``rho``
    ends a phase within its first two looks in 95 % of phases: the look j passes with probability
    ≈ Φ(δ/se - t_j) - RISE_LEVEL (t_j: the spent level's quantile, 18 degrees of freedom), and the two looks'
    windows are disjoint. Found by bisection. (Simulated, tests/observers/test_alpha_plateau.py: window 4000 at
    CV 0.5, ρ 0.5 resolves 0.0043 by this formula; a flat loss ends within two looks in 98-99 % at δ 0.005.)"""
    from statistics import NormalDist

    phi = NormalDist().cdf
    se = rate_standard_error(window, cv, rho)
    dof = BLOCKS - 2 if window >= BLOCKS else window - 2
    t1, t2 = (float(t_quantile(look_level(j), dof)) for j in (1, 2))
    lo, hi = 0.0, 100.0 * se
    for _ in range(60):
        mid = (lo + hi) / 2
        p1, p2 = (max(phi(mid / se - t) - RISE_LEVEL, 0.0) for t in (t1, t2))
        lo, hi = (mid, hi) if 1 - (1 - p1) * (1 - p2) < 0.95 else (lo, mid)
    return hi


def resolution_lines(schedule: Any, experts: int, max_steps: int) -> list[str]:
    """What ``wantrain check`` prints for an enabled schedule: per phase δ, the first look (expert steps in the
    phase) and the smallest slope its window resolves at per-step CV 0.3 and 0.5 with AR(1) correlation
    :data:`AUTOCORRELATION` between steps (:func:`smallest_resolvable_rate`),
    and whether a flat loss reaches the last phase within ``max_steps`` (each of ``experts`` experts trains
    ``max_steps / experts`` of them) -- each phase ending by its second look. The last phase never ends, so the
    preset's min_steps does not apply to it; a min_steps set on it is asked for as steps in it (short of them is
    said, not "raise train.max_steps")."""
    window = schedule.resolved("window")
    lines = [f"alpha schedule: window {window} expert steps; a flat loss ends a phase within its first two looks "
             "(95 %) when the phase's delta is at least the smallest resolvable slope"]
    reach = entered = 0
    for i, phase in enumerate(schedule.phases):
        min_steps = int(phase.criterion("min_steps", schedule.preset))
        if i == len(schedule.phases) - 1:  # it never ends: only a min_steps set on it asks for steps in it
            stay = f"then {phase.min_steps} steps in it" if phase.min_steps else "then the rest of the run"
            lines.append(f"  {phase.name}: the last phase, entered by expert step {reach} on a flat loss (every "
                         f"phase before it ending by its second look), {stay}")
            entered, reach = reach, reach + (phase.min_steps or 0)
            break
        first = max(min_steps, window)
        delta = phase.criterion("loss_improvement_rate_below", schedule.preset)
        resolvable = [smallest_resolvable_rate(window, cv, AUTOCORRELATION) for cv in (0.3, 0.5)]
        smallest = " / ".join(f"{r:.2g}" for r in resolvable)
        verdict = "" if delta is None or delta >= resolvable[1] else \
            " -- below the CV 0.5 resolution: on video noise this phase may not end"
        lines.append(f"  {phase.name}: delta {delta if delta is not None else '-'} per 100 steps, looks at expert "
                     f"steps {first}, {first + window}, ... in the phase; smallest resolvable slope {smallest} per 100 "
                     f"steps at per-step CV 0.3 / 0.5 (AR(1) rho {AUTOCORRELATION:g}){verdict}")
        reach += first + window
    per_expert = max_steps // max(experts, 1)
    ok = "" if reach <= per_expert else \
        " -- raise train.max_steps or lower min_steps/window to reach every phase" if entered > per_expert else \
        f" -- every phase is reached; the last gets {per_expert - entered} of its min_steps {reach - entered}"
    lines.append(f"  the run gives each expert {per_expert} steps; the schedule needs {reach}{ok}")
    return lines
