"""Property tests of the alpha schedule's plateau rule on synthetic loss streams (no model, numpy + the real
statistics): 200 seeds per case, the ``video`` preset (window 4000, δ = 0.5 % per 100 steps, min_steps 4000).

The decision math is the real one: :func:`~wantrain.observers.alpha.stats.series_statistics` on every look's
window (all seeds and looks at once) and :func:`~wantrain.observers.alpha.controller.plateau_look` on the result;
:func:`test_the_vectorised_looks_decide_as_the_policy_does` checks that the real :class:`AlphaPolicy`, fed the same
logged values, ends the same phases at the same looks.

A stream is ``mean(t) × noise`` per expert step, the noise multiplicative with mean 1 and per-step CV 0.05, 0.3 or
0.5 (flow-matching video losses: 0.3-0.5), of four kinds: ``iid`` log-normal; ``ar1`` -- log-normal with AR(1)
correlation ρ = 0.5 between consecutive steps (shared data order, momentum); ``mixture`` -- the step's timestep
decides its loss level (30 % of steps at a level ~3x the others', a little log-normal noise on top), scaled to
the CV; ``spikes`` -- iid plus 1 % of steps x5. The rates in docs/alpha_schedule.md ("Measured") are these tests'.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from wantrain.observers.alpha.config import ALPHA_PRESETS, AlphaPhase, AlphaScheduleConfig
from wantrain.observers.alpha.controller import AlphaPolicy, plateau_look
from wantrain.observers.alpha.stats import series_statistics

SEEDS = 200
PRESET = ALPHA_PRESETS["video"]
WINDOW, DELTA, MIN_STEPS = int(PRESET["window"]), float(PRESET["loss_improvement_rate_below"]), int(
    PRESET["min_steps"])
FIRST = max(MIN_STEPS, WINDOW)  # the first look: a full window of the phase's own losses


def noise(kind: str, cv: float, seeds: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """Multiplicative noise of mean 1 and per-step CV ``cv`` (see the module docstring)."""
    if kind == "mixture":  # timestep draw: 30 % of steps at level high, 70 % at low, mean 1, plus CV 0.05
        p, within = 0.3, 0.05
        spread = math.sqrt(max(((1 + cv * cv) / (1 + within * within) - 1) / (p * (1 - p)), 0.0))
        low = 1 - p * spread
        level = np.where(rng.random((seeds, steps)) < p, low + spread, low)
        s = math.sqrt(math.log(1 + within * within))
        return level * np.exp(rng.normal(-s * s / 2, s, (seeds, steps)))
    s = math.sqrt(math.log(1 + cv * cv))
    if kind == "ar1":  # e_t = Σ_k ρ^k·sqrt(1-ρ²)·ε_{t-k}, truncated at ρ^32 ~ 2e-10, as one FFT convolution
        rho, lags = 0.5, 32
        white = rng.normal(0.0, s, (seeds, steps + lags))
        kernel = math.sqrt(1 - rho * rho) * rho ** np.arange(lags)
        size = 1 << (steps + 2 * lags - 1).bit_length()  # a power of two: a fast FFT
        e = np.fft.irfft(np.fft.rfft(white, size) * np.fft.rfft(kernel, size), size)[:, lags: lags + steps]
    else:
        e = rng.normal(0.0, s, (seeds, steps))
    out = np.exp(e - s * s / 2)
    if kind == "spikes":
        out = np.where(rng.random((seeds, steps)) < 0.01, 5.0 * out, out)
    return out


def ends(losses: np.ndarray, delta: float = DELTA, window: int = WINDOW, first: int = FIRST) -> np.ndarray:
    """The look (1-based) at which each stream's phase ends, 0: never. ``losses[:, t]`` is the loss of the phase's
    expert step t + 1; look j reads the window of steps ``first + (j-1)·window - window + 1 .. first + (j-1)·window``
    (the policy's looks: disjoint windows, all in the phase)."""
    seeds, steps = losses.shape
    looks = (steps - first) // window + 1
    start = first - window
    windows = losses[:, start: start + looks * window].reshape(seeds, looks, window)
    stats = series_statistics(torch.from_numpy(windows))
    rate, se, dof = (stats[f"loss_improvement_rate{s}"].numpy() for s in ("", "_se", "_dof"))
    stopped, rising, _ = plateau_look(rate, se, dof, np.arange(1, looks + 1), delta)
    ended = stopped & ~rising
    return np.where(ended.any(1), ended.argmax(1) + 1, 0)


def look_step(look: np.ndarray) -> np.ndarray:
    """The expert step (in the phase) of look ``look``."""
    return FIRST + (look - 1) * WINDOW


def stream(mean: np.ndarray, kind: str, cv: float, seed: int) -> np.ndarray:
    return mean * noise(kind, cv, SEEDS, len(mean), np.random.default_rng(seed))


def constant_rate(rate: float, steps: int) -> np.ndarray:
    """A loss changing by ``rate`` of itself per 100 steps (positive: falling)."""
    return np.exp(-rate / 100 * np.arange(steps))


KINDS = ["iid", "ar1", "mixture", "spikes"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cv", [0.05, 0.3, 0.5])
def test_a_rising_loss_never_ends_a_phase(cv, kind):
    """Issue 34: a loss rising 2 % per 100 steps ended the foundation phase in 200 of 200 seeds. Here 1 % (faster
    rises are held with more margin)."""
    losses = stream(constant_rate(-0.01, FIRST + 4 * WINDOW), kind, cv, seed=int(10 * cv))
    assert (ends(losses) == 0).all()  # five looks, 200 seeds: not one transition


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cv", [0.05, 0.3, 0.5])
def test_a_loss_still_falling_at_delta_ends_at_most_5_percent_of_phases_over_all_looks(cv, kind):
    """Issue 34: re-testing at every log step ended 32 % of such phases."""
    losses = stream(constant_rate(DELTA, FIRST + 5 * WINDOW), kind, cv, seed=int(100 * cv) + len(kind))
    assert (ends(losses) > 0).mean() <= 0.05  # six looks (the levels of all later looks add < 0.2 %)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cv", [0.05, 0.3, 0.5])
def test_a_flat_loss_ends_within_min_steps_and_two_windows(cv, kind):
    """Also with AR(1) ρ 0.5 at CV 0.5, which triples the slope's variance: the preset's window is sized for it
    (measured over 1000 seeds: 98.6 % within two looks; window 3000 gave 77 %)."""
    losses = stream(np.ones(FIRST + WINDOW), kind, cv, seed=int(100 * cv) + 7)
    ended = ends(losses)
    assert ((ended >= 1) & (ended <= 2)).mean() >= 0.95, np.bincount(ended)


@pytest.mark.parametrize(("kind", "cv"), [("iid", 0.05), ("iid", 0.3), ("iid", 0.5), ("mixture", 0.3),
                                          ("mixture", 0.5), ("ar1", 0.05), ("ar1", 0.3), ("ar1", 0.5)])
def test_a_falling_then_flat_loss_ends_after_its_decrease_falls_below_delta(cv, kind):
    amplitude, tau, steps = 1.0, 3000.0, FIRST + 7 * WINDOW
    t = np.arange(steps)
    mean = 1 + amplitude * np.exp(-t / tau)
    rate = 100 * (amplitude / tau) * np.exp(-t / tau) / mean  # the true decrease per 100 steps
    ended = ends(stream(mean, kind, cv, seed=int(tau + 100 * cv)))
    at = look_step(np.maximum(ended, 1)) - 1
    assert ((ended > 0) & (rate[np.minimum(at, steps - 1)] >= DELTA)).mean() <= 0.05
    assert (ended > 0).mean() >= 0.95, np.bincount(ended)


def test_the_presets_see_the_slope_of_a_slow_lora_curve():
    """Issue 34: 1 + 0.15·e^(−t/2000) ended the phase at step ~680 (δ 0.05) while it still fell 0.5 %/100 steps;
    with the preset no phase ends before that curve's decrease is under 0.3 % per 100 steps."""
    t = np.arange(FIRST + 4 * WINDOW)
    mean = 1 + 0.15 * np.exp(-t / 2000)
    rate = 100 * (0.15 / 2000) * np.exp(-t / 2000) / mean
    for cv in (0.3, 0.5):
        ended = ends(stream(mean, "iid", cv, seed=int(100 * cv)))
        assert (ended > 0).all() and (rate[look_step(ended) - 1] < 0.003).all()


def test_the_vectorised_looks_decide_as_the_policy_does():
    schedule = AlphaScheduleConfig(enabled=True, preset="video", phases=[
        AlphaPhase(name="a", alpha=4.0, min_gradient_stability=0.0), AlphaPhase(name="b", alpha=8.0)])
    seeds, steps = 12, FIRST + 5 * WINDOW
    t = np.arange(steps)
    losses = (1 + 0.5 * np.exp(-t / 4000)) * noise("iid", 0.5, seeds, steps, np.random.default_rng(5))
    expected = ends(losses)
    assert len(set(expected.tolist())) > 1  # the seeds differ, so the comparison means something
    log_every = 250
    for s in range(seeds):
        policy, ended = AlphaPolicy(schedule, (None,)), 0
        for step in range(log_every, steps + 1, log_every):
            window = torch.from_numpy(losses[s, max(0, step - WINDOW): step].copy())
            if len(window) < WINDOW:
                window = torch.cat([torch.full((WINDOW - len(window),), math.nan, dtype=window.dtype), window])
            values = {f"alpha/{k}/lora": float(v) for k, v in series_statistics(window).items()}
            values.update({"alpha/steps/lora": float(step), "alpha/gradient_stability/lora": 0.75})
            if policy.observe(step, values):
                ended = policy.history[0]["steps_in_phase"]
                break
        assert ended == (look_step(expected[s]) if expected[s] else 0), s
