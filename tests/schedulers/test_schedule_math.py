import math

import pytest
import torch

from wantrain.core.errors import ConfigError
from wantrain.schedulers import lr_at, warmup_steps_for

from .helpers_sched import sched_cfg

BASE = 1e-4


def decay_cfg(**kw):
    table = {"type": "cosine_annealing_warm_restarts_decay", "T_0": 10, "eta_min": 1e-7, "gamma": 0.9}
    table.update(kw)
    return sched_cfg(**table)


def test_restart_steps_start_exactly_at_the_decayed_peak():
    cfg = decay_cfg()
    for k in range(5):
        assert lr_at(cfg, BASE, 10 * k, 100) == BASE * 0.9**k


def test_each_decayed_cycle_follows_the_cosine_down_to_eta_min():
    cfg = decay_cfg()
    for k in range(3):
        peak = BASE * 0.9**k
        for t_cur in (1, 5, 9):
            expected = 1e-7 + (peak - 1e-7) * (1 + math.cos(math.pi * t_cur / 10)) / 2
            assert lr_at(cfg, BASE, 10 * k + t_cur, 100) == pytest.approx(expected, rel=1e-12)


def test_lr_never_rises_above_the_decayed_peak_within_a_cycle():
    cfg = decay_cfg(T_mult=1.5, eta_min=3e-5, gamma=0.5)  # eta_min exceeds the peak from cycle 2 on
    lrs = [lr_at(cfg, BASE, s, 400) for s in range(400)]
    starts = [0, 10, 25, 48, 82, 133, 210, 325]
    for k, (a, b) in enumerate(zip(starts, starts[1:] + [400])):
        cycle = lrs[a:b]
        assert max(cycle) == cycle[0] == BASE * 0.5**k
        assert all(later <= earlier for earlier, later in zip(cycle, cycle[1:]))


def test_eta_min_above_the_decayed_peak_holds_the_cycle_flat_at_the_peak():
    cfg = decay_cfg(eta_min=5e-5, gamma=0.5)
    assert [lr_at(cfg, BASE, s, 40) for s in range(20, 30)] == [BASE * 0.25] * 10


def test_fractional_t_mult_rounds_cycle_lengths_to_whole_steps():
    cfg = decay_cfg(T_mult=1.5, gamma=1.0)
    # lengths 10, 15, 22.5 -> 23, 33.75 -> 34: restarts at 10, 25, 48, 82
    lrs = [lr_at(cfg, BASE, s, 100) for s in range(100)]
    rises = [s for s in range(1, 100) if lrs[s] > lrs[s - 1]]
    assert rises == [10, 25, 48, 82]
    assert lrs[47] == pytest.approx(1e-7 + (BASE - 1e-7) * (1 + math.cos(math.pi * 22 / 23)) / 2, rel=1e-12)


def test_integer_t_mult_without_decay_matches_torch_cosine_annealing_warm_restarts():
    cfg = decay_cfg(T_0=5, T_mult=2, eta_min=1e-6, gamma=1.0)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE)
    ref = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5, T_mult=2, eta_min=1e-6)
    for step in range(80):
        assert lr_at(cfg, BASE, step, 80) == pytest.approx(ref.get_last_lr()[0], rel=1e-9)
        opt.step()
        ref.step()


def test_cycle_limit_holds_the_last_floor_and_stops_restarting():
    cfg = decay_cfg(cycle_limit=2, eta_min=1e-6)
    lrs = [lr_at(cfg, BASE, s, 60) for s in range(60)]
    assert lrs[10] == BASE * 0.9
    assert lrs[20:] == [1e-6] * 40


def test_cosine_decays_once_over_the_run_without_rebound():
    cfg = sched_cfg(type="cosine", eta_min=1e-6)
    lrs = [lr_at(cfg, BASE, s, 50) for s in range(60)]
    assert lrs[0] == BASE
    assert lrs[25] == pytest.approx((BASE + 1e-6) / 2, rel=1e-12)
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))
    assert lrs[50:] == [1e-6] * 10


def test_linear_goes_from_start_factor_to_end_factor_over_the_run():
    cfg = sched_cfg(type="linear", start_factor=1.0, end_factor=0.1)
    assert lr_at(cfg, BASE, 0, 11) == BASE
    assert lr_at(cfg, BASE, 5, 11) == pytest.approx(BASE * (1 - 0.9 * 5 / 11))


def test_linear_total_iters_holds_end_factor_afterwards():
    cfg = sched_cfg(type="linear", end_factor=0.0, total_iters=4)
    assert [lr_at(cfg, 1.0, s, 10) for s in range(7)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]


def test_constant_stays_at_the_base_lr():
    cfg = sched_cfg(type="constant")
    assert {lr_at(cfg, BASE, s, 30) for s in range(30)} == {BASE}


def test_integer_warmup_is_a_count_of_optimizer_steps():
    cfg = sched_cfg(type="constant", warmup_steps=10)
    assert warmup_steps_for(cfg, 100) == 10
    assert [lr_at(cfg, 1.0, s, 100) for s in (0, 5, 9, 10, 50)] == [0.0, 0.5, 0.9, 1.0, 1.0]


def test_fractional_warmup_is_a_share_of_the_run():
    cfg = sched_cfg(type="constant", warmup_steps=0.05)
    assert warmup_steps_for(cfg, 1000) == 50
    assert warmup_steps_for(cfg, 200) == 10
    assert lr_at(cfg, 1.0, 5, 200) == 0.5


def test_warmup_start_factor_sets_the_first_step_lr():
    cfg = sched_cfg(type="constant", warmup_steps=4, warmup_start_factor=0.2)
    assert [lr_at(cfg, 1.0, s, 10) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_main_schedule_runs_over_the_steps_left_after_warmup():
    cfg = sched_cfg(type="cosine", warmup_steps=20)
    assert lr_at(cfg, BASE, 20, 120) == BASE
    assert lr_at(cfg, BASE, 70, 120) == pytest.approx(BASE / 2, rel=1e-12)  # half of the 100 remaining steps


@pytest.mark.parametrize("value", [1.0, 100.0])
def test_warmup_written_as_integral_float_is_rejected_with_both_spellings(value):
    with pytest.raises(ConfigError) as err:
        sched_cfg(type="constant", warmup_steps=value)
    msg = str(err.value)
    assert "lr_scheduler.warmup_steps" in msg and "ambiguous" in msg
    assert f"warmup_steps = {int(value)})" in msg and "warmup_steps = 0.05" in msg
    assert "\n" not in msg


def test_warmup_non_integral_above_one_is_rejected():
    with pytest.raises(ConfigError, match="warmup_steps = 2.5 is ambiguous"):
        sched_cfg(warmup_steps=2.5)


def test_warmup_as_long_as_the_run_is_rejected_naming_the_key():
    cfg = sched_cfg(type="cosine", warmup_steps=100)
    with pytest.raises(ConfigError, match=r"lr_scheduler.warmup_steps = 100 .* 100 optimizer steps"):
        lr_at(cfg, BASE, 0, 100)
