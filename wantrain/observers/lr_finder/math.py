"""The arithmetic of the learning-rate range test: the sweep, the smoothing, the stop rule and the suggestions.

Host floats only (no torch): the observer (``lr_finder.py``) feeds it the rung losses it read from logged metrics,
so everything here can be tested on synthetic curves and replayed from an event log.

* :func:`sweep_lrs` -- the tested LRs, both end points exact: ``exp``: ``start * (end/start) ** (k/(n-1))``;
  ``linear``: ``start + (end-start) * k/(n-1)``, ``k = 0..n-1``.
* :class:`Smoother` -- the bias-corrected EMA ``a_k = beta*a_{k-1} + (1-beta)*x_k``, ``s_k = a_k / (1-beta**(k+1))``
  (fastai's and Lightning's; the seed's EMA started at the first value with no correction). Causal: it lags the
  sweep by about ``1/(1-beta)`` rungs, so it drives the online stop rule and the chart, not the suggestions.
* :func:`centred` -- the zero-lag curve the suggestions read: the bias-corrected EMA run forward, then backward
  over that result (a forward-backward filter, so the lag cancels).
* :func:`diverged` -- the stop rule: a non-finite raw loss, or (after ``burn_in`` rungs) a smoothed loss above
  ``factor * best`` smoothed loss.
* :func:`suggest` -- the three suggestions: ``steepest`` (most negative slope of the centred loss against
  log10(LR)), ``valley`` (middle of the longest decreasing subsequence of the centred loss, fastai's default),
  ``minimum`` (LR of the lowest centred loss, divided by 10), plus warnings when the minimum sits at either end of
  the sweep or the curve is too flat to trust.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

# The first rungs are dominated by the random start (fastai and torch-lr-finder skip 10 %).
SKIP_START_FRACTION = 0.1
# A drop of the centred curve below this share of its starting value is "too flat to trust".
FLAT_RELATIVE_DROP = 0.02
MIN_POINTS = 5


def sweep_lrs(start: float, end: float, n: int, mode: str = "exp") -> list[float]:
    """``n`` learning rates from ``start`` to ``end`` inclusive (exactly: the last one *is* ``end``)."""
    if n < 2:
        raise ValueError(f"a sweep needs at least 2 learning rates, got {n}")
    out = []
    for k in range(n):
        r = k / (n - 1)
        out.append(start * (end / start) ** r if mode == "exp" else start + (end - start) * r)
    out[0], out[-1] = float(start), float(end)  # no rounding at the ends
    return out


@attrs.define
class Smoother:
    """Online bias-corrected EMA. :meth:`add` returns the smoothed value after ``x``."""

    beta: float
    _avg: float = 0.0
    _count: int = 0

    def add(self, x: float) -> float:
        self._count += 1
        self._avg = self.beta * self._avg + (1 - self.beta) * x
        return self._avg / (1 - self.beta**self._count) if self.beta > 0 else x

    def state_dict(self) -> dict[str, float]:
        return {"avg": self._avg, "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._avg, self._count = float(state["avg"]), int(state["count"])


def ema(values: Sequence[float], beta: float) -> list[float]:
    """The bias-corrected EMA of ``values`` (what :class:`Smoother` gives, as a list)."""
    s = Smoother(beta)
    return [s.add(v) for v in values]


def centred(values: Sequence[float], beta: float) -> list[float]:
    """Zero-lag smoothing: :func:`ema` forward, then :func:`ema` backward over the result."""
    return ema(ema(values, beta)[::-1], beta)[::-1]


def diverged(raw: float, smoothed: float, best: float, rung: int, *, factor: float, burn_in: int) -> str | None:
    """Why the sweep should stop after rung ``rung`` (0-based), or None. ``best`` is the lowest smoothed loss so far
    (``smoothed`` included)."""
    if not math.isfinite(raw):
        return f"the loss is not finite ({raw})"
    if rung >= burn_in and smoothed > factor * best:
        return f"the smoothed loss {smoothed:.4g} exceeds {factor:g} x the best {best:.4g}"
    return None


@attrs.frozen
class Suggestion:
    """The outcome of one sweep. ``lrs`` maps each method to its LR (None when it had too few points);
    ``default`` names the method whose LR is *the* suggestion; ``warnings`` are sentences for the user."""

    lrs: dict[str, float | None]
    default: str
    warnings: tuple[str, ...]
    indices: dict[str, int | None]

    @property
    def lr(self) -> float | None:
        return self.lrs.get(self.default)


def steepest_index(log_lrs: Sequence[float], losses: Sequence[float]) -> int:
    """Index of the most negative slope d(loss)/d(log10 LR) (central differences, one-sided at the ends)."""
    slope = np.gradient(np.asarray(losses, dtype=float), np.asarray(log_lrs, dtype=float))
    return int(np.argmin(slope))


def valley_index(losses: Sequence[float]) -> int:
    """Middle of the longest strictly decreasing subsequence of ``losses`` (first and last index of that subsequence,
    averaged, rounded down). O(n^2) like fastai's; n is a few hundred at most."""
    n = len(losses)
    length, prev = [1] * n, [-1] * n
    for i in range(n):
        for j in range(i):
            if losses[j] > losses[i] and length[j] + 1 > length[i]:
                length[i], prev[i] = length[j] + 1, j
    end = max(range(n), key=lambda i: (length[i], -i))  # the longest; the earliest on ties
    start = end
    while prev[start] >= 0:
        start = prev[start]
    return (start + end) // 2


def suggest(lrs: Sequence[float], losses: Sequence[float], *, beta: float, default: str = "valley",
            stopped_early: bool = False) -> Suggestion:
    """Suggestions from the rungs' raw ``losses`` at ``lrs`` (a diverged sweep's last, non-finite rung may be
    included: non-finite rungs are dropped). ``stopped_early``: the divergence rule ended the sweep (so a minimum
    at the last rung is not "the end LR is too low")."""
    points = [(lr, x) for lr, x in zip(lrs, losses, strict=True) if math.isfinite(x)]
    methods = ("valley", "steepest", "minimum")
    if len(points) < MIN_POINTS:
        return Suggestion(dict.fromkeys(methods), default,
                          (f"only {len(points)} finite losses: too few for a suggestion; widen the sweep or lower "
                           "lr_finder.start_lr",), dict.fromkeys(methods))
    x = [p[0] for p in points]
    curve = centred([p[1] for p in points], beta)
    n = len(curve)
    skip = int(n * SKIP_START_FRACTION)
    log_x = [math.log10(v) for v in x]
    window = curve[skip:]
    i_min = skip + int(np.argmin(window))
    i_steep = skip + steepest_index(log_x[skip:], window)
    i_valley = skip + valley_index(window)
    indices = {"valley": i_valley, "steepest": i_steep, "minimum": i_min}
    out = {"valley": x[i_valley], "steepest": x[i_steep], "minimum": x[i_min] / 10}
    warnings = []
    if i_min <= skip:
        warnings.append(f"the lowest loss is at the start of the sweep (LR {x[i_min]:.3g}): the curve never "
                        "descends; lower lr_finder.start_lr")
    if i_min == n - 1 and not stopped_early:
        warnings.append(f"the lowest loss is at the end of the sweep (LR {x[i_min]:.3g}) and it never diverged: "
                        "raise lr_finder.end_lr")
    top = max(curve[: i_min + 1])
    drop = top - curve[i_min]
    if drop <= FLAT_RELATIVE_DROP * abs(top):
        warnings.append(f"the curve is too flat to trust (the smoothed loss falls by {100 * drop / abs(top):.2g} % "
                        "before its minimum); try lr_finder.noise = 'fixed', more lr_finder.steps_per_lr, or a "
                        "wider range")
    return Suggestion(out, default, tuple(warnings), indices)
