import json

import pytest

from wantrain.core.errors import ConfigError
from wantrain.schedulers import build_scheduler, lr_at

from .helpers_sched import run_steps, sched_cfg, two_expert_optimizer

DECAY = dict(type="cosine_annealing_warm_restarts_decay", T_0=12, T_mult=1.5, eta_min=1e-6, gamma=0.8,
             warmup_steps=5)


def test_construction_sets_lr_of_step_zero_and_k_steps_give_lr_of_step_k():
    cfg = sched_cfg(**DECAY)
    opt = two_expert_optimizer()
    scheduler = build_scheduler(cfg, opt, total_steps=80)
    seen = run_steps(opt, scheduler, 80)
    for step, lrs in enumerate(seen):
        assert lrs == [lr_at(cfg, 1e-4, step, 80), lr_at(cfg, 5e-5, step, 80)]


def test_each_group_keeps_its_own_base_lr():
    cfg = sched_cfg(**DECAY)
    opt = two_expert_optimizer(high=2e-4, low=1e-4)
    scheduler = build_scheduler(cfg, opt, total_steps=80)
    run_steps(opt, scheduler, 17)  # step 17 = warmup 5 + first restart at 12
    assert scheduler.get_last_lr() == [2e-4 * 0.8, 1e-4 * 0.8]
    assert [g["name"] for g in opt.param_groups] == ["high_noise", "low_noise"]


def resumed_sequence(cfg, total, stop_at, *, load_optimizer_state):
    opt = two_expert_optimizer()
    scheduler = build_scheduler(cfg, opt, total_steps=total)
    first = run_steps(opt, scheduler, stop_at)
    saved_sched = json.loads(json.dumps(scheduler.state_dict()))
    saved_opt = opt.state_dict()
    fresh = two_expert_optimizer()
    if load_optimizer_state:
        fresh.load_state_dict(saved_opt)
    resumed = build_scheduler(cfg, fresh, total_steps=total)
    resumed.load_state_dict(saved_sched)
    return first + run_steps(fresh, resumed, total - stop_at)


@pytest.mark.parametrize("load_optimizer_state", [True, False])
def test_builtin_run_resumed_mid_cycle_reproduces_the_lr_sequence(load_optimizer_state):
    cfg = sched_cfg(**DECAY)
    opt = two_expert_optimizer()
    uninterrupted = run_steps(opt, build_scheduler(cfg, opt, total_steps=90), 90)
    # step 23 is mid-way through the second cycle (restart at 5 + 12 = 17)
    assert resumed_sequence(cfg, 90, 23, load_optimizer_state=load_optimizer_state) == uninterrupted


@pytest.mark.parametrize("load_optimizer_state", [True, False])
def test_external_steplr_resumed_reproduces_the_lr_sequence(load_optimizer_state):
    cfg = sched_cfg(type="external", **{"class": "torch.optim.lr_scheduler.StepLR"}, step_size=7, gamma=0.5)
    opt = two_expert_optimizer()
    uninterrupted = run_steps(opt, build_scheduler(cfg, opt, total_steps=40), 40)
    assert resumed_sequence(cfg, 40, 18, load_optimizer_state=load_optimizer_state) == uninterrupted


def test_builtin_state_is_the_step_and_json_safe():
    cfg = sched_cfg(**DECAY)
    opt = two_expert_optimizer()
    scheduler = build_scheduler(cfg, opt, total_steps=50)
    run_steps(opt, scheduler, 9)
    assert json.loads(json.dumps(scheduler.state_dict())) == {
        "kind": "closed_form", "type": DECAY["type"], "step": 9, "total_steps": 50}


def test_external_state_into_a_builtin_schedule_is_a_config_error():
    ext = sched_cfg(type="external", **{"class": "torch.optim.lr_scheduler.StepLR"}, step_size=7)
    opt = two_expert_optimizer()
    state = build_scheduler(ext, opt, total_steps=10).state_dict()
    builtin = build_scheduler(sched_cfg(type="cosine"), two_expert_optimizer(), total_steps=10)
    with pytest.raises(ConfigError, match="resume with the schedule the run was started with"):
        builtin.load_state_dict(state)
