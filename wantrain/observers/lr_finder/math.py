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
* :func:`suggestion_curve` -- what the suggestions read, robust to a diverged tail: the rungs up to the first
  non-finite loss; after a divergence stop the last :data:`TRIM_END` rungs dropped (the stop rung and the 4
  before it: fastai and torch-lr-finder drop 5 too; fewer when that would leave under :data:`MIN_POINTS`); the
  raw losses clipped at :data:`CLIP_FACTOR` x the running best causal smoothed loss (so the backward pass cannot
  carry a tail that stayed in the window back into the curve); then :func:`centred`.
* :func:`suggest` -- the three suggestions on that curve after its first 10 %: ``valley`` (half-way down the
  descent: midway, in rungs, between where the curve has fallen :data:`DESCENT_MARGIN` of its drop and where it
  is within that share of its minimum), ``steepest`` (most negative slope against log10(LR)), ``minimum`` (LR of
  the lowest point / 10); warnings, the invalidating ones marked: too few points, the minimum at the start, or a
  descent no larger than the noise (:data:`FLAT_NOISE_RATIO` x the standard deviation of the raw losses around
  the curve) or than 2 % of the loss.
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
# After a divergence stop the last rungs carry the explosion: the stop rung and the 4 before it are left out
# (fastai and torch-lr-finder drop the last 5 points as well).
TRIM_END = 5
# Raw losses are clipped at this multiple of the running best (causal, smoothed) loss before the centred smoothing,
# whose backward pass would otherwise carry a 10x loss 10-20 rungs back into the curve.
CLIP_FACTOR = 2.0
# The valley is half-way down the descent, between where the curve has fallen this share of its drop and where it is
# within this share of its minimum.
DESCENT_MARGIN = 0.1
# A descent is trusted when it exceeds this multiple of the noise (standard deviation of the raw losses around the
# centred curve). Curves with no LR dependence stay below 0.95 in 99 % of 400 seeds at any noise level
# (tests/observers/test_lr_finder_curves.py).
FLAT_NOISE_RATIO = 1.0


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
    ``default`` names the method whose LR is *the* suggestion; ``warnings`` are sentences for the user, of which
    ``invalid`` are the ones that make the suggestion meaningless. ``curve`` is the smoothed curve the suggestions
    read, one value per input rung (None for rungs left out); ``noise`` the standard deviation of the used raw
    losses around it; ``descent`` the curve's drop before its minimum."""

    lrs: dict[str, float | None]
    default: str
    warnings: tuple[str, ...]
    indices: dict[str, int | None]
    invalid: tuple[str, ...] = ()
    curve: tuple[float | None, ...] = ()
    noise: float = math.nan
    descent: float = math.nan

    @property
    def lr(self) -> float | None:
        return self.lrs.get(self.default)

    @property
    def trusted(self) -> bool:
        """An LR exists and no warning invalidates it."""
        return self.lr is not None and not self.invalid


def steepest_index(log_lrs: Sequence[float], losses: Sequence[float]) -> int:
    """Index of the most negative slope d(loss)/d(log10 LR) (central differences, one-sided at the ends)."""
    slope = np.gradient(np.asarray(losses, dtype=float), np.asarray(log_lrs, dtype=float))
    return int(np.argmin(slope))


def valley_index(curve: Sequence[float]) -> int:
    """Half-way down the descent of ``curve`` (which ends at its minimum): from its highest point, the first index
    where it has fallen :data:`DESCENT_MARGIN` of its drop and the first where it is within that share of its last
    value; their midpoint, rounded down."""
    y = np.asarray(curve, dtype=float)
    i_top = int(np.argmax(y))
    top, low = y[i_top], y[-1]
    drop = top - low
    tail = y[i_top:]
    begin = i_top + int(np.argmax(tail <= top - DESCENT_MARGIN * drop))
    end = i_top + int(np.argmax(tail <= low + DESCENT_MARGIN * drop))
    return (begin + end) // 2


def suggestion_curve(losses: Sequence[float], *, beta: float, stopped_early: bool) -> tuple[list[int], list[float],
                                                                                            list[float]]:
    """(indices of the rungs used, their clipped raw losses, the centred curve over them); see the module
    docstring."""
    used = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            break
        used.append(i)
    if stopped_early:  # the stop rung and the ones before it, keeping MIN_POINTS of a short sweep
        keep = len(losses) - min(TRIM_END, max(len(losses) - MIN_POINTS, 1))
        used = [i for i in used if i < keep]
    smoother, best, clipped = Smoother(beta), math.inf, []
    for i in used:
        best = min(best, smoother.add(losses[i]))
        clipped.append(min(losses[i], CLIP_FACTOR * best))
    return used, clipped, centred(clipped, beta)


def suggest(lrs: Sequence[float], losses: Sequence[float], *, beta: float, default: str = "valley",
            stopped_early: bool = False) -> Suggestion:
    """Suggestions from the rungs' raw ``losses`` at ``lrs`` (a diverged sweep's last, non-finite rung may be
    included). ``stopped_early``: the divergence rule ended the sweep (its tail is trimmed, and a minimum at the last
    rung is not "the end LR is too low")."""
    if len(lrs) != len(losses):
        raise ValueError(f"{len(lrs)} learning rates but {len(losses)} losses")
    methods = ("valley", "steepest", "minimum")
    used, clipped, curve = suggestion_curve(losses, beta=beta, stopped_early=stopped_early)
    if len(used) < MIN_POINTS:
        text = (f"only {len(used)} usable losses before the loss diverged or turned non-finite: too few for a "
                "suggestion; lower lr_finder.start_lr or raise lr_finder.steps")
        return Suggestion(dict.fromkeys(methods), default, (text,), dict.fromkeys(methods), invalid=(text,),
                          curve=(None,) * len(losses))
    x = [lrs[i] for i in used]
    n = len(curve)
    skip = int(n * SKIP_START_FRACTION)
    log_x = [math.log10(v) for v in x]
    window = curve[skip:]
    i_min = skip + int(np.argmin(window))
    i_steep = skip + steepest_index(log_x[skip:], window)
    i_valley = skip + valley_index(curve[skip:i_min + 1])
    indices = {"valley": used[i_valley], "steepest": used[i_steep], "minimum": used[i_min]}
    out = {"valley": x[i_valley], "steepest": x[i_steep], "minimum": x[i_min] / 10}
    noise = float(np.std(np.asarray(clipped) - np.asarray(curve)))
    top = max(curve[skip: i_min + 1])
    drop = top - curve[i_min]
    warnings, invalid = [], []
    if i_min <= skip:
        text = (f"the lowest loss is at the start of the sweep (LR {x[i_min]:.3g}): the curve never descends; lower "
                "lr_finder.start_lr")
        warnings.append(text)
        invalid.append(text)
    if i_min == n - 1 and not stopped_early:
        warnings.append(f"the lowest loss is at the end of the sweep (LR {x[i_min]:.3g}) and it never diverged: "
                        "raise lr_finder.end_lr")
    if drop <= FLAT_RELATIVE_DROP * abs(top) or drop < FLAT_NOISE_RATIO * noise:
        text = (f"the curve is too flat to trust: the smoothed loss falls by {drop:.3g} ({100 * drop / abs(top):.2g} "
                f"%) before its minimum, against a noise of {noise:.3g} per LR; use lr_finder.noise = 'probe', more "
                "lr_finder.steps_per_lr, or a wider range")
        if text not in invalid:
            warnings.append(text)
            invalid.append(text)
    by_rung: list[float | None] = [None] * len(losses)
    for i, value in zip(used, curve, strict=True):
        by_rung[i] = value
    return Suggestion(out, default, tuple(warnings), indices, invalid=tuple(invalid), curve=tuple(by_rung),
                      noise=noise, descent=drop)
