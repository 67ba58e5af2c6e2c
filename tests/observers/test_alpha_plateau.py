"""Property tests of the alpha schedule's exit rule on synthetic loss streams (no model): the real window
statistics (``observers.alpha.stats``, batched over seeds on the CPU) feed the real :class:`AlphaPolicy` with the
``video`` preset.

A stream: ``L(t) = 1 + A·exp(-t/tau)`` per optimizer step, times log-normal noise of per-step CV 0.05, 0.3 or
0.5 (flow-matching video losses: 0.3-0.5); gradient stability per step ~ N(0.75, 0.05), what the tiny I2V twin's
converging run shows (examples/i2v_a14b_alpha_schedule.toml, 600 steps: 0.72-0.81). The plateau begins where the
true relative decrease falls below the preset's 5 % per 100 steps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from wantrain.observers.alpha.config import AlphaPhase, AlphaScheduleConfig
from wantrain.observers.alpha.controller import AlphaPolicy
from wantrain.observers.alpha.stats import DeviceWindow, loss_statistics, window_mean

SEEDS = 200
LOG_EVERY = 10
DELAY = {0.05: 800, 0.3: 1200, 0.5: 1600}  # steps after the plateau's start within which >= 95 % of seeds end


def _schedule(**phase):
    return AlphaScheduleConfig(enabled=True, preset="video",
                               phases=[AlphaPhase(name="a", alpha=4.0, **phase), AlphaPhase(name="b", alpha=8.0)])


def _run(schedule, losses, stability):
    """The step (1-based) at which each seed's first phase ends (-1: never)."""
    seeds, steps = losses.shape
    window = schedule.resolved("window")
    loss_window = DeviceWindow(window, "cpu", batch=(seeds,))
    stability_window = DeviceWindow(window, "cpu", batch=(seeds,))
    policies = [AlphaPolicy(schedule, (None,)) for _ in range(seeds)]
    ended = np.full(seeds, -1)
    for t in range(steps):
        loss_window.push(torch.from_numpy(losses[:, t]))
        stability_window.push(torch.from_numpy(stability[:, t]))
        step = t + 1
        if step % LOG_EVERY:
            continue
        stats = {name: value.numpy() for name, value in loss_statistics(loss_window).items()}
        stats["gradient_stability"] = window_mean(stability_window).numpy()
        for s in np.flatnonzero(ended < 0):
            values = {f"alpha/{name}/lora": float(v[s]) for name, v in stats.items()}
            values["alpha/steps/lora"] = float(step)
            if policies[s].observe(step, values):
                ended[s] = step
    return ended


def _streams(cv, amplitude, tau, steps, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    mean = 1 + amplitude * np.exp(-t / tau)
    sigma = math.sqrt(math.log(1 + cv * cv))
    losses = mean * np.exp(rng.normal(-sigma * sigma / 2, sigma, (SEEDS, steps)))
    stability = rng.normal(0.75, 0.05, (SEEDS, steps))
    rate = 100 * (amplitude / tau) * np.exp(-t / tau) / mean  # the true relative decrease per 100 steps
    return losses, stability, rate


@pytest.mark.parametrize("cv", [0.05, 0.3, 0.5])
@pytest.mark.parametrize(("amplitude", "tau"), [(1.0, 300.0), (3.0, 600.0)])
def test_a_phase_ends_after_the_plateau_begins_and_not_while_the_loss_still_falls(cv, amplitude, tau):
    steps = 4000
    losses, stability, rate = _streams(cv, amplitude, tau, steps, seed=int(cv * 100 + tau))
    ended = _run(_schedule(), losses, stability)
    plateau = int(np.argmax(rate < 0.05))  # first step whose true decrease is below 5 % per 100 steps
    assert plateau > 0
    early = np.mean((ended >= 0) & (ended - 1 < plateau))
    falling = np.mean((ended >= 0) & (rate[np.clip(ended - 1, 0, steps - 1)] >= 0.05))
    in_time = np.mean((ended >= plateau) & (ended <= plateau + DELAY[cv]))
    assert early <= 0.05 and falling <= 0.05, (early, falling)
    assert in_time >= 0.95, (in_time, np.percentile(ended - plateau, [5, 50, 95]))


@pytest.mark.parametrize("cv", [0.3, 0.5])
def test_a_rising_loss_never_ends_a_phase(cv):
    steps = 3000
    rng = np.random.default_rng(7)
    t = np.arange(steps)
    sigma = math.sqrt(math.log(1 + cv * cv))
    losses = np.exp(0.001 * t) * np.exp(rng.normal(-sigma * sigma / 2, sigma, (SEEDS, steps)))  # +10 % / 100 steps
    stability = rng.normal(0.75, 0.05, (SEEDS, steps))
    assert (_run(_schedule(), losses, stability) < 0).all()
