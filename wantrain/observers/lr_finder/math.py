"""The arithmetic of the learning-rate range test: the sweep, the smoothing, the stop rule and the suggestions.

Host floats only (no torch): the observer (``lr_finder.py``) feeds it the rung losses it read from logged metrics,
so everything here can be tested on synthetic curves and replayed from an event log.

* :func:`sweep_lrs` -- the tested LRs, both end points exact: ``exp``: ``start * (end/start) ** (k/(n-1))``;
  ``linear``: ``start + (end-start) * k/(n-1)``, ``k = 0..n-1``.
* :class:`Smoother` -- the bias-corrected EMA ``a_k = beta*a_{k-1} + (1-beta)*x_k``, ``s_k = a_k / (1-beta**(k+1))``
  (fastai's and Lightning's; the seed's EMA started at the first value with no correction). Causal: it lags the
  sweep by about ``1/(1-beta)`` rungs, so it drives the online stop rule and the chart, not the suggestions.
* :func:`centred` -- the forward-backward EMA (kept for the bench's residual CV; the suggestions no longer read it:
  a zero-phase smoother spreads a cliff over both sides, issue 34).
* :func:`running_median` -- what the suggestions read: a centred running median of :data:`MEDIAN_WIDTH` rungs
  (edges padded with the end values). A median leaves any monotone stretch exactly as it is, so a cliff stays a
  cliff however sharp, while noise and single outlier rungs are removed.
* :func:`diverged` -- the stop rule: a non-finite raw loss, or (after ``burn_in`` rungs) a *sustained* rise: the
  median of the last :data:`SUSTAIN` raw losses above ``factor`` x the lowest such median so far (one outlier rung
  cannot stop the sweep, two in a row can).
* :func:`suggestion_curve` -- what the suggestions read, robust to a diverged tail: the rungs up to the first
  non-finite loss; after a divergence stop the last :data:`TRIM_END` rungs dropped (fewer when that would leave under
  :data:`MIN_POINTS`); the raw losses clipped at :data:`CLIP_FACTOR` x the running best level; then
  :func:`running_median`.
* :func:`suggest` -- the three suggestions on that curve after its first 10 %: ``valley`` (half-way down the descent
  by level: the first rung below the midpoint between the curve's highest point and its minimum, after the last one
  above it, read on :func:`causal_median`), ``steepest`` (most negative slope against log10(LR)), ``minimum`` (LR of
  the lowest point / 10); a 90 % band for the default suggestion (:func:`bootstrap_band`: the curve's multiplicative
  residuals resampled :data:`BOOTSTRAP` times, a fixed seed so replay reproduces it); warnings, every one of which
  questions the suggestion (so ``trusted`` needs none): too few points, a divergence stop on a rise within
  :data:`RISE_NOISE` noise standard deviations (:func:`stop_rise`), the minimum at the start, the minimum at the
  end of a sweep that never diverged, a descent no larger than the noise or 2 % of the loss, and a band wider than
  :data:`BAND_FACTOR`.
"""

from __future__ import annotations

import math
import statistics
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
# curve); the band (below) refuses what this lets through on flat curves.
FLAT_NOISE_RATIO = 0.5
# Rungs of the running median the suggestions read (odd): wide enough to average CV 0.3 noise down ~2.5x, and a
# median keeps monotone stretches exact whatever its width.
MEDIAN_WIDTH = 9
# Raw losses whose median must exceed diverge_factor x the best for a divergence stop: three high rungs of five.
SUSTAIN = 5
# Bootstrap resamples of the suggestion's band, its seed (fixed: the band is a function of the logged losses), and
# the widest band (hi / lo) a trusted suggestion may have: a factor of 3 is half a decade.
BOOTSTRAP = 200
BOOTSTRAP_SEED = 0
BAND_FACTOR = 3.0
BAND_LEVEL = 0.9
# A divergence stop counts for the suggestion only when the rise it stopped on (log of the stop level over the lowest
# level) exceeds this many standard deviations of the per-rung noise of the log losses: a flat curve's levels
# (medians of 5) scatter by ~0.54 of that each, so a rise of 4 is ~5 of their standard deviations above a
# fluctuation; noise at CV 0.5 alone reaches the 4x stop factor in ~15 % of flat sweeps, at ~3 (issue 34).
RISE_NOISE = 4.0


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


def _middle(windows: np.ndarray) -> np.ndarray:
    """The median over the last axis of an odd-length window (a sort: faster than ``np.median`` on short rows)."""
    return np.sort(windows, axis=-1)[..., windows.shape[-1] // 2]


def running_median(values: Sequence[float] | np.ndarray, width: int = MEDIAN_WIDTH) -> np.ndarray:
    """The centred running median of ``values`` over their last axis (rows independent), ``width`` rungs (odd), the
    ends padded with the first and last values (a monotone stretch stays exactly as it is)."""
    y = np.asarray(values, dtype=float)
    half = width // 2
    if y.shape[-1] == 0 or half == 0:
        return y.copy()
    pad = [(0, 0)] * (y.ndim - 1) + [(half, half)]
    padded = np.pad(y, pad, mode="edge")
    return _middle(np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1, axis=-1))


def causal_median(values: Sequence[float] | np.ndarray, width: int = MEDIAN_WIDTH) -> np.ndarray:
    """The running median of each rung and the ``width - 1`` before it (the past only; the start padded with the
    first value; ``width`` odd), over the last axis. It lags a descent by about ``width // 2`` rungs and never runs
    ahead of one."""
    y = np.asarray(values, dtype=float)
    if y.shape[-1] == 0 or width <= 1:
        return y.copy()
    padded = np.pad(y, [(0, 0)] * (y.ndim - 1) + [(width - 1, 0)], mode="edge")
    return _middle(np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1))


def level(raw: Sequence[float]) -> float:
    """The sweep's current level for the stop rule: the median of the last :data:`SUSTAIN` raw losses (NaN when
    one of them is not finite)."""
    last = [float(v) for v in raw[-SUSTAIN:]]
    if not all(math.isfinite(v) for v in last):
        return math.nan
    return statistics.median(last)


def levels(raw: Sequence[float]) -> np.ndarray:
    """:func:`level` after each rung of ``raw`` (all finite), at once."""
    y = np.asarray(raw, dtype=float)
    out = np.empty(len(y))
    for k in range(min(SUSTAIN - 1, len(y))):  # the first rungs: fewer than SUSTAIN values
        out[k] = float(np.median(y[: k + 1]))
    if len(y) >= SUSTAIN:
        out[SUSTAIN - 1:] = _middle(np.lib.stride_tricks.sliding_window_view(y, SUSTAIN))
    return out


def diverged(raw: float, current: float, best: float, rung: int, *, factor: float, burn_in: int) -> str | None:
    """Why the sweep should stop after rung ``rung`` (0-based), or None. ``current`` is :func:`level` after this
    rung, ``best`` the lowest level so far (``current`` included)."""
    if not math.isfinite(raw):
        return f"the loss is not finite ({raw})"
    if rung >= burn_in and current > factor * best:
        return (f"the loss (median of the last {SUSTAIN} LRs) {current:.4g} exceeds {factor:g} x its lowest "
                f"{best:.4g}")
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
    band: tuple[float, float] | None = None

    @property
    def lr(self) -> float | None:
        return self.lrs.get(self.default)

    @property
    def trusted(self) -> bool:
        """An LR exists and no warning questions it."""
        return self.lr is not None and not self.invalid


def valley_index(curve: Sequence[float]) -> int:
    """Half-way down the descent of ``curve`` (which ends at its minimum), by level: the first index below the
    midpoint between its highest value and its last, after the last one at or above it (the last index when the
    curve is flat). On a cliff that is the first rung down it, however sharp the cliff; noise on the plateau before
    it cannot pull it there (it would have to stay below the midpoint until the cliff)."""
    y = np.asarray(curve, dtype=float)
    mid = (y.max() + y[-1]) / 2
    return min(int(np.flatnonzero(y >= mid)[-1]) + 1, len(y) - 1)


def _indices(curve: np.ndarray, causal: np.ndarray, log_x: np.ndarray, skip: int) -> dict[str, np.ndarray]:
    """The three methods' indices on each row of ``curve`` (the centred running median; rows: the curve and its
    bootstrap resamples): ``steepest`` and ``minimum`` on it, ``valley`` -- where ``causal`` (the causal running
    median of the same rungs) first falls below the midpoint between the highest point before the minimum and the
    minimum, after the last rung at or above it. The causal curve never crosses before the descent does: with noise
    the centred one crosses a sharp cliff a rung or two early, on the plateau."""
    rows, n = curve.shape
    window = curve[:, skip:]
    i_min = skip + np.argmin(window, axis=1)
    slope = np.gradient(window, log_x[skip:], axis=1) if n - skip > 1 else np.zeros_like(window)
    i_steep = skip + np.argmin(slope, axis=1)
    idx = np.arange(n)
    before = (idx >= skip) & (idx <= i_min[:, None])
    top = np.where(before, curve, -np.inf).max(axis=1)
    mid = (top + curve[np.arange(rows), i_min]) / 2
    above = before & (causal >= mid[:, None])
    i_valley = np.minimum(n - 1 - np.argmax(above[:, ::-1], axis=1) + 1, i_min)
    return {"valley": i_valley, "steepest": i_steep, "minimum": i_min}


def bootstrap_band(clipped: Sequence[float], curve: Sequence[float], log_x: Sequence[float], skip: int,
                   method: str) -> tuple[int, int]:
    """The :data:`BAND_LEVEL` band of ``method``'s index: the raw losses' ratios to the curve are resampled with
    replacement (:data:`BOOTSTRAP` times, seed :data:`BOOTSTRAP_SEED`), put back on the curve, smoothed like the
    curve, and the method re-run on each; returns the lower and upper percentile indices."""
    y, c = np.asarray(clipped, dtype=float), np.asarray(curve, dtype=float)
    ratios = y / np.where(c != 0, c, 1.0)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    resampled = c * ratios[rng.integers(0, len(y), (BOOTSTRAP, len(y)))]
    found = _indices(running_median(resampled), causal_median(resampled), np.asarray(log_x, dtype=float),
                     skip)[method]
    tail = (1 - BAND_LEVEL) / 2 * 100
    lo, hi = np.percentile(found, [tail, 100 - tail], method="nearest")
    return int(lo), int(hi)


def log_noise(raw: Sequence[float]) -> float:
    """The per-rung noise of ``log(raw)`` (positive, finite values): a robust standard deviation from successive
    differences, 1.4826·median|Δ log y|/√2 -- a trend or a cliff moves a few differences only, not their median
    (NaN with fewer than 3 values or a value <= 0)."""
    y = np.asarray(raw, dtype=float)
    if len(y) < 3 or not (y > 0).all():
        return math.nan
    return float(1.4826 * np.median(np.abs(np.diff(np.log(y)))) / math.sqrt(2))


def stop_rise(losses: Sequence[float], used: int) -> tuple[float, float]:
    """(the rise the stop rule stopped on: log of the last :func:`level` over the lowest one, the per-rung noise of
    the log losses of the first ``used`` rungs) of a sweep whose last rung is finite."""
    lv = levels(losses)
    return float(math.log(lv[-1] / lv.min())), log_noise(losses[:used])


def suggestion_curve(losses: Sequence[float], *, beta: float, stopped_early: bool) -> tuple[list[int], list[float],
                                                                                            list[float]]:
    """(indices of the rungs used, their clipped raw losses, the running median over them); see the module
    docstring. (``beta`` is not used: the curve is a median)."""
    used = []
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            break
        used.append(i)
    if stopped_early:  # the stop rung and the ones before it, keeping MIN_POINTS of a short sweep
        keep = len(losses) - min(TRIM_END, max(len(losses) - MIN_POINTS, 1))
        used = [i for i in used if i < keep]
    raw = np.asarray([losses[i] for i in used], dtype=float)
    best = np.minimum.accumulate(levels(raw)) if len(raw) else raw
    clipped = [float(v) for v in np.minimum(raw, CLIP_FACTOR * best)]
    return used, clipped, [float(v) for v in running_median(clipped)]

# How each method's LR is named wherever it is shown (console, log, chart): ``minimum`` is a tenth of the LR at the
# lowest loss, so it is never printed beside that LR as if it were it.
LABELS = {"valley": "valley", "steepest": "steepest", "minimum": "minimum / 10"}


def suggest(lrs: Sequence[float], losses: Sequence[float], *, beta: float, default: str = "valley",
            stopped_early: bool = False, band: bool = True, probe: bool = False) -> Suggestion:
    """Suggestions from the rungs' raw ``losses`` at ``lrs`` (a diverged sweep's last, non-finite rung may be
    included). ``stopped_early``: the divergence rule ended the sweep (its tail is trimmed, and a minimum at the last
    rung is not "the end LR is too low"). ``band=False`` leaves out the bootstrap band and its check (the costly
    part: a suggestion trusted without it may still be refused by it; one not trusted without it never is).
    ``probe``: the sweep already measured on the fixed probe (``lr_finder.noise = "probe"``), so the warnings do not
    suggest it."""
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
    log_x = np.log10(np.asarray(x, dtype=float))
    rows = _indices(np.asarray(curve)[None, :], causal_median(clipped)[None, :], log_x, skip)
    found = {k: int(v[0]) for k, v in rows.items()}
    i_min, i_steep, i_valley = found["minimum"], found["steepest"], found["valley"]
    indices = {"valley": used[i_valley], "steepest": used[i_steep], "minimum": used[i_min]}
    out = {"valley": x[i_valley], "steepest": x[i_steep], "minimum": x[i_min] / 10}
    noise = float(np.std(np.asarray(clipped) - np.asarray(curve)))
    top = max(curve[skip: i_min + 1])
    drop = top - curve[i_min]
    interval = None
    if band:
        b_lo, b_hi = bootstrap_band(clipped, curve, log_x, skip, default)
        scale = 0.1 if default == "minimum" else 1.0
        interval = (x[b_lo] * scale, x[b_hi] * scale)
    quieter = "more lr_finder.steps_per_lr" if probe else "lr_finder.noise = 'probe' or more lr_finder.steps_per_lr"
    warnings = []
    if stopped_early and math.isfinite(losses[-1]) and all(v > 0 for v in losses):
        rise, sigma = stop_rise(losses, len(used))
        if not rise > RISE_NOISE * sigma:
            warnings.append(f"the sweep stopped on a rise within the noise: its level rose {math.exp(rise):.3g}x, "
                            f"{rise / sigma:.2g} standard deviations of the log losses' noise per LR (a "
                            f"divergence needs {RISE_NOISE:g}); the curve may never have diverged: use {quieter}")
    if i_min <= skip:
        warnings.append(f"the lowest loss is at the start of the sweep (LR {x[i_min]:.3g}): the curve never "
                        "descends; lower lr_finder.start_lr")
    if i_min == n - 1 and not stopped_early:
        warnings.append(f"the lowest loss is at the end of the sweep (LR {x[i_min]:.3g}) and it never diverged: "
                        "raise lr_finder.end_lr")
    if drop <= FLAT_RELATIVE_DROP * abs(top) or drop < FLAT_NOISE_RATIO * noise:
        warnings.append(f"the curve is too flat to trust: the smoothed loss falls by {drop:.3g} "
                        f"({100 * drop / abs(top):.2g} %) before its minimum, against a noise of {noise:.3g} per LR; "
                        f"use {quieter.replace(' or ', ', ')}, or a wider range")
    if interval is not None and interval[1] > BAND_FACTOR * interval[0]:
        lo, hi = interval
        warnings.append(f"the suggestion is uncertain: its {BAND_LEVEL:.0%} band {lo:.3g}-{hi:.3g} is "
                        f"{hi / lo:.3g}x wide (more than {BAND_FACTOR:g}x); use {quieter}")
    invalid = list(warnings)  # every warning questions the suggestion
    by_rung: list[float | None] = [None] * len(losses)
    for i, value in zip(used, curve, strict=True):
        by_rung[i] = value
    return Suggestion(out, default, tuple(warnings), indices, invalid=tuple(invalid), curve=tuple(by_rung),
                      noise=noise, descent=drop, band=interval)
