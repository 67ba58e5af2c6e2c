"""The alpha controller's statistics on streams with known answers (window regression, CV, sign agreement)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from wantrain.observers.alpha.stats import DeviceWindow, SignAgreement, loss_statistics, window_mean


def _window(values, size):
    w = DeviceWindow(size, "cpu")
    for v in values:
        w.push(torch.tensor(float(v)))
    return w


def _host(stats):
    return {k: v.item() for k, v in stats.items()}


def test_linear_loss_stream_gives_its_slope_r2_one_and_the_relative_rate():
    # y_i = 2 - 0.01 i, i = 0..49: slope -0.01, R^2 = 1, mean 1.755, improvement 100*0.01/1.755 per 100 steps
    stats = _host(loss_statistics(_window([2 - 0.01 * i for i in range(50)], 50)))
    assert stats["loss_slope"] == pytest.approx(-0.01, rel=1e-6)
    assert stats["loss_r2"] == pytest.approx(1.0, rel=1e-6)
    assert stats["loss_improvement_rate"] == pytest.approx(1.0 / 1.755, rel=1e-6)
    std = 0.01 * math.sqrt((50**2 - 1) / 12)  # population std of an arithmetic sequence
    assert stats["loss_cv"] == pytest.approx(std / 1.755, rel=1e-6)
    assert stats["loss_samples"] == 50


def test_window_keeps_only_the_last_values_in_order_after_wrapping():
    # 30 values rising, then 40 falling: a window of 40 sees only the falling part
    stream = [float(i) for i in range(30)] + [100 - 0.5 * i for i in range(40)]
    stats = _host(loss_statistics(_window(stream, 40)))
    assert stats["loss_slope"] == pytest.approx(-0.5, rel=1e-6) and stats["loss_samples"] == 40
    assert _window(stream, 40).host_values() == stream[-40:]


def test_alternating_losses_have_no_trend_and_a_known_cv():
    stream = [1.0, 3.0] * 20
    stats = _host(loss_statistics(_window(stream, 40)))  # mean 2, population std 1
    assert stats["loss_cv"] == pytest.approx(0.5, rel=1e-6)
    slope, _ = np.polyfit(np.arange(40), stream, 1)
    r = np.corrcoef(np.arange(40), stream)[0, 1]
    assert stats["loss_slope"] == pytest.approx(slope, rel=1e-6)
    assert stats["loss_r2"] == pytest.approx(r * r, rel=1e-6) and stats["loss_r2"] < 0.01


def test_non_finite_losses_are_left_out_of_the_statistics():
    clean = [1.0 + 0.1 * i for i in range(10)]
    with_nan = clean[:4] + [math.nan] + clean[4:]  # a skipped step between positions 3 and 5
    stats = _host(loss_statistics(_window(with_nan, 11)))
    assert stats["loss_samples"] == 10
    assert stats["loss_r2"] < 1.0  # the gap shifts the positions: the fit sees the real spacing
    assert stats["loss_slope"] == pytest.approx(0.1 * 10 / 11, rel=0.05)


def test_constant_losses_have_zero_r2_and_zero_cv():
    stats = _host(loss_statistics(_window([0.5] * 20, 20)))
    assert stats["loss_r2"] == 0.0 and stats["loss_cv"] == 0.0 and stats["loss_slope"] == 0.0


def test_sign_agreement_counts_kept_signs_among_nonzero_products():
    signs = SignAgreement()
    assert signs.update([torch.tensor([1.0, -2.0, 3.0, 0.0]), torch.tensor([[5.0, -1.0]])]) is None
    # kept: +,-,+ (3) and -> second tensor +,- becomes -,- (1 kept, 1 flipped); zero stays out
    value = signs.update([torch.tensor([0.5, -0.1, 9.0, 4.0]), torch.tensor([[-5.0, -1.0]])])
    assert value.item() == pytest.approx(4 / 5)
    flipped = signs.update([torch.tensor([-0.5, 0.1, -9.0, -4.0]), torch.tensor([[5.0, 1.0]])])
    assert flipped.item() == 0.0


def test_sign_agreement_of_random_gradients_is_near_one_half():
    g = torch.Generator().manual_seed(0)
    signs = SignAgreement()
    values = []
    for _ in range(5):
        value = signs.update([torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g)])
        if value is not None:
            values.append(value.item())
    assert all(abs(v - 0.5) < 0.03 for v in values)


def test_sign_agreement_restarts_after_reset_and_window_mean_ignores_nan():
    signs = SignAgreement()
    signs.update([torch.ones(3)])
    signs.reset()
    assert signs.update([torch.ones(3)]) is None
    assert window_mean(_window([0.2, math.nan, 0.6], 5)).item() == pytest.approx(0.4)


def test_a_window_saved_with_another_size_keeps_its_newest_values_in_order():
    # lora.alpha_schedule.window changed between a run and its resume (issue 25.8: a shape crash before)
    saved = DeviceWindow(5, "cpu")
    for v in range(7):
        saved.push(torch.tensor(float(v)))
    smaller, larger = DeviceWindow(3, "cpu"), DeviceWindow(10, "cpu")
    smaller.load_state_dict(saved.state_dict())
    larger.load_state_dict(saved.state_dict())
    assert smaller.host_values() == [4.0, 5.0, 6.0]
    assert larger.host_values() == [2.0, 3.0, 4.0, 5.0, 6.0]
    larger.push(torch.tensor(7.0))
    assert larger.host_values() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert float(loss_statistics(larger)["loss_slope"]) == 1.0  # positions stay chronological
