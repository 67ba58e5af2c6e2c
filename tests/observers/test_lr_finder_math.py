"""The LR finder's arithmetic on synthetic curves with known answers (``wantrain.observers.lr_finder.math``)."""

from __future__ import annotations

import math

import pytest

from wantrain.observers.lr_finder.math import (
    centred,
    diverged,
    ema,
    level,
    running_median,
    suggest,
    sweep_lrs,
    valley_index,
)


def test_exp_and_linear_sweeps_hit_both_end_points_exactly():
    exp = sweep_lrs(1e-7, 10.0, 100, "exp")
    assert len(exp) == 100 and exp[0] == 1e-7 and exp[-1] == 10.0
    ratios = [b / a for a, b in zip(exp, exp[1:], strict=False)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)  # evenly spaced in log(LR)
    lin = sweep_lrs(1e-4, 1e-3, 10, "linear")
    assert lin[0] == 1e-4 and lin[-1] == 1e-3
    assert lin[1] - lin[0] == pytest.approx(1e-4, rel=1e-9)


def test_bias_corrected_ema_has_no_start_bias_and_the_centred_curve_no_lag():
    assert ema([2.0] * 5, 0.98) == pytest.approx([2.0] * 5)  # without correction it would start at 0.04
    ramp = [float(i) for i in range(41)]
    lagging = ema(ramp, 0.8)
    assert lagging[20] < 17  # the causal EMA lags a ramp by about beta/(1-beta) = 4 points
    assert centred(ramp, 0.8)[20] == pytest.approx(20.0, abs=0.2)  # forward-backward: the lag cancels


def _grid(n=101):
    return [10 ** (-7 + 8 * k / (n - 1)) for k in range(n)]  # 1e-7 .. 10, log10 step 0.08


def test_steepest_descent_in_log_lr_is_the_inflection_of_a_tanh_curve():
    lrs = _grid()
    center = math.log10(lrs[60])  # -2.2
    losses = [1.0 - math.tanh((math.log10(x) - center) / 0.5) for x in lrs]
    for beta in (0.0, 0.6):  # the centred smoothing keeps the inflection of a symmetric step in place
        s = suggest(lrs, losses, beta=beta)
        assert s.indices["steepest"] == 60
        assert s.lrs["steepest"] == lrs[60]


def test_valley_is_half_way_down_the_descent():
    assert valley_index([5, 4, 3, 2, 1]) == 3  # the first value below the midpoint 3
    assert valley_index([1, 9, 8, 7, 6, 5, 4, 3]) == 5  # midpoint of the highest point (9) and the end (3): 6
    assert valley_index([9, 9, 9, 9, 8, 5, 2, 1, 1]) == 6  # a plateau before the descent does not count
    assert valley_index([9, 9, 9, 9, 9, 1, 1, 1, 1]) == 5  # a cliff: its first rung down
    lrs = _grid()
    losses = [100.0 - k if k <= 70 else 30.0 + (k - 70) ** 2 for k in range(101)]  # V, bottom at rung 70
    s = suggest(lrs, losses, beta=0.0)
    # the first 10 % are skipped: the decreasing stretch is rungs 10..70, half-way down by level at rung 40; the
    # valley reads the causal median, which lags a steady descent by up to MEDIAN_WIDTH // 2 = 4 rungs
    assert 40 <= s.indices["valley"] <= 45 and s.lrs["valley"] == lrs[s.indices["valley"]]
    assert s.default == "valley" and s.lr == s.lrs["valley"]


def test_minimum_suggestion_is_a_tenth_of_the_lr_at_the_lowest_loss():
    lrs = _grid()
    losses = [(k - 55) ** 2 + 1.0 for k in range(101)]
    s = suggest(lrs, losses, beta=0.0, default="minimum")
    # the running median (9 rungs) turns the parabola's tip into a short flat bottom; its first rung is taken
    assert 51 <= s.indices["minimum"] <= 55
    assert s.lrs["minimum"] == pytest.approx(lrs[s.indices["minimum"]] / 10)
    assert s.lr == s.lrs["minimum"] and s.warnings == () and s.trusted


def test_warns_when_the_minimum_sits_at_the_end_of_a_sweep_that_never_diverged():
    lrs = _grid()
    falling = [10.0 - 0.05 * k for k in range(101)]
    assert any("end of the sweep" in w for w in suggest(lrs, falling, beta=0.0).warnings)
    # the same curve cut by the stop rule is fine: the stop explains the end
    assert not any("end of the sweep" in w for w in suggest(lrs, falling, beta=0.0, stopped_early=True).warnings)


def test_warns_when_the_minimum_sits_at_the_start_of_the_sweep():
    lrs = _grid()
    rising = [1.0 + 0.05 * k for k in range(101)]
    assert any("start of the sweep" in w for w in suggest(lrs, rising, beta=0.0).warnings)


def test_warns_when_the_curve_is_too_flat_to_trust():
    lrs = _grid()
    flat = [1.0 + 0.001 * math.sin(k) for k in range(101)]
    assert any("too flat" in w for w in suggest(lrs, flat, beta=0.0).warnings)
    good = [1.0 - 0.5 * math.tanh((k - 50) / 10) for k in range(101)]
    assert not any("too flat" in w for w in suggest(lrs, good, beta=0.0).warnings)


def test_non_finite_rungs_are_dropped_and_too_few_points_give_no_suggestion():
    s = suggest([1e-3, 1e-2, 1e-1], [1.0, 0.5, math.nan], beta=0.0)
    assert s.lr is None and s.lrs == {"valley": None, "steepest": None, "minimum": None}
    assert "too few" in s.warnings[0]


def test_divergence_rule_fires_on_nan_at_once_and_on_an_explosion_only_after_burn_in():
    assert "not finite" in diverged(math.nan, math.nan, 1.0, 0, factor=4, burn_in=10)
    assert "not finite" in diverged(math.inf, 5.0, 1.0, 3, factor=4, burn_in=10)
    assert diverged(5.0, 5.0, 1.0, 9, factor=4, burn_in=10) is None  # in the burn-in
    assert "exceeds 4 x" in diverged(5.0, 5.0, 1.0, 10, factor=4, burn_in=10)
    assert diverged(3.9, 3.9, 1.0, 50, factor=4, burn_in=10) is None


def test_the_running_median_keeps_a_cliff_sharp_and_drops_a_single_outlier():
    cliff = [1.0] * 30 + [0.5] * 30
    assert list(running_median(cliff)) == cliff  # a monotone stretch is left exactly as it is
    spiked = list(cliff)
    spiked[40] = 40.0
    assert list(running_median(spiked)) == cliff
    assert centred(cliff, 0.9)[25] < 0.95  # the forward-backward EMA starts the descent 5 rungs early


def test_one_or_two_outlier_rungs_do_not_stop_the_sweep_but_a_sustained_rise_does():
    """Issue 34: a single x40 rung mid-descent ended the sweep (the EMA jumped past 4 x its best)."""
    raws, best, stops = [], float("inf"), []
    for rung, raw in enumerate([1.0] * 20 + [40.0] + [0.9] * 5 + [40.0, 40.0] + [0.9] * 4 + [40.0] * 3):
        raws.append(raw)
        current = level(raws)
        best = min(best, current)
        stops.append(diverged(raw, current, best, rung, factor=4, burn_in=10) is not None)
    assert stops.index(True) == 34  # the third high rung of five, not the single one at 20 nor the pair at 26-27
