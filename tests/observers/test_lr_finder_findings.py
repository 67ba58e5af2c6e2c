"""Issue 34's findings on the LR finder, each a test through an entry the finder had before that issue
(``suggest``, ``sweep_lrs`` and the :class:`LrFinder` observer fed ``MetricsLogged`` events, as replay feeds it), so
that each fails by its assertion on the code before the fix, not by a missing name. Numpy only, no model; the
property tests with their rates are in test_lr_finder_curves.py.
"""

from __future__ import annotations

import math

import numpy as np

from wantrain.observers.lr_finder.math import suggest, sweep_lrs

N, START, END, BETA = 100, 1e-7, 10.0, 0.9


def _cheap_options() -> dict:
    """``band=False`` where ``suggest`` has it: the bootstrap band is the costly part, left out where only the cheap
    checks or the valley matter (the code before issue 34 had no band to leave out)."""
    import inspect

    return {"band": False} if "band" in inspect.signature(suggest).parameters else {}


_CHEAP = _cheap_options()


def _cliff(rng, depth=None):
    """Flat, then a descent within less than 0.7 decade (a sigmoid in log10 LR, 10-90 % over 4.4 x its width),
    a floor, then an abrupt x31 divergence. Returns the LRs, the clean losses up to the sweep's stop -- the third
    rung past the divergence onset, where a sustained-rise stop ends it -- and the right answers: from 10 % of the
    descent done to the clean minimum."""
    lrs = np.array(sweep_lrs(START, END, N))
    x = np.log10(lrs)
    base = rng.uniform(0.05, 1.0)
    drop = (rng.uniform(0.2, 0.6) if depth is None else depth) * base
    middle, width = rng.uniform(-5, -2.5), rng.uniform(0.02, 0.15)
    clean = base - drop / (1 + np.exp(-(x - middle) / width))
    onset = middle + rng.uniform(1.0, 2.0)
    clean = np.where(x > onset, base * 31.0 * np.exp(np.clip(3 * (x - onset), 0, 50)), clean)
    stop = int(np.argmax(x > onset)) + 2
    i_min = int(np.argmin(clean))
    i_lo = int(np.argmax(clean <= base - 0.1 * drop))
    return lrs[: stop + 1], clean[: stop + 1], (lrs[i_lo], lrs[i_min])


def _noisy(rng, clean, cv):
    return list(clean * np.exp(rng.normal(-cv * cv / 2, cv, len(clean)))) if cv else list(clean)


def test_the_valley_of_a_sharp_cliff_is_on_its_descent_at_cv_03():
    """Issue 34: the forward-backward EMA spread a cliff over +-10 rungs and the valley landed on the flat part
    before it in 77-79 % of seeds (target: on the descent in >= 90 % at CV 0.3). Measured: 182 of 200."""
    rng = np.random.default_rng(41)
    hits = 0
    for _ in range(200):
        lrs, clean, (lo, hi) = _cliff(rng)
        s = suggest(list(lrs), _noisy(rng, clean, 0.3), beta=BETA, stopped_early=True, **_CHEAP)
        hits += s.lrs["valley"] is not None and lo * (1 - 1e-9) <= s.lrs["valley"] <= hi * (1 + 1e-9)
    assert hits >= 180, f"valley on the descent in {hits} of 200"


def test_a_trusted_suggestion_on_a_real_20_percent_descent_comes_with_a_band_on_the_descent():
    """Issue 34: such sweeps at CV 0.3 were refused as too flat or trusted without any band (no measure of how
    far the suggestion could be off). Now a trusted one has a 90 % band, and the band covers the descent."""
    rng = np.random.default_rng(3)
    trusted = covered = 0
    for _ in range(200):
        lrs, clean, (lo, hi) = _cliff(rng, depth=0.2)
        losses = _noisy(rng, clean, 0.3)
        if not suggest(list(lrs), losses, beta=BETA, stopped_early=True, **_CHEAP).trusted:
            continue  # refused before its band is looked at (the band only refuses more)
        s = suggest(list(lrs), losses, beta=BETA, stopped_early=True)
        band = getattr(s, "band", None)  # the code before issue 34 had none
        trusted += s.trusted
        covered += s.trusted and band is not None and band[0] <= hi and band[1] >= lo
    # measured: 2 of 200 trusted (a 20 % descent at CV 0.3, one loss per LR, is at the noise floor: the band
    # refuses the rest), both bands on the descent; on the code before issue 34, 43 passed with no band
    assert trusted >= 1 and covered == trusted, (trusted, covered)


def test_a_minimum_at_the_end_of_a_sweep_that_never_diverged_is_not_trusted():
    """Issue 34: with suggestion = "minimum" on a sweep that never diverged, then-train trained the quickstart at
    LR 0.75 (config 2e-3): the warning was not one that questioned the suggestion."""
    lrs = sweep_lrs(START, END, N)
    falling = [1.0 - 0.5 * math.tanh((k - 60) / 10) for k in range(N)]  # still falling at the last LR
    s = suggest(lrs, falling, beta=BETA, default="minimum")
    assert s.lr is not None and not s.trusted
    assert any("never diverged" in w for w in s.invalid)


class _Control:
    def __init__(self):
        self.stops = []

    def request_stop(self, reason):
        self.stops.append(reason)


def test_one_outlier_rung_does_not_end_the_sweep():
    """Issue 34: a single x40 rung mid-descent stopped the sweep (the EMA jumped past 4 x its best) and the
    suggestion, trusted, fell below the descent. The observer fed the logged losses, as replay feeds it."""
    from wantrain.core.events import MetricsLogged
    from wantrain.observers.lr_finder.config import LrFinderConfig
    from wantrain.observers.lr_finder.observer import LrFinder

    steps = 60
    cfg = LrFinderConfig(enabled=True, steps=steps, start_lr=1e-6, end_lr=1e-1, noise="random", burn_in=10)
    finder = LrFinder(cfg, experts=(None,), grad_accum=1)
    ctx = type("Ctx", (), {"control": _Control()})()
    losses = [1.0 - 0.5 * math.tanh((k - 30) / 6) for k in range(steps)]
    losses[25] *= 40.0  # one outlier rung mid-descent
    for step, loss in enumerate(losses, start=1):
        finder.on_metrics_logged(MetricsLogged(step=step, expert=None, values={"train/loss": loss}, elapsed_s=0.0,
                                               total_steps=steps), ctx)
    result = finder.results[None]
    assert result.rungs == steps and result.stop_reason is None, result.stop_reason
    assert ctx.control.stops == []

