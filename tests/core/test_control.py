"""The control object's LR requests: checked at the call, applied by the core for exactly one step."""

from __future__ import annotations

import math

import pytest
import torch

from wantrain.core.bus import Bus
from wantrain.core.config import structure
from wantrain.core.control import Control
from wantrain.core.events import OptimizerStepped, StepStarted
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.schedulers import SchedulerConfig, build_scheduler

from .fakes import LinearAdapter, linear_batches

SCHEDULERS = {
    "exponential": {"type": "external", "class": "torch.optim.lr_scheduler.ExponentialLR", "gamma": 0.9},
    "step": {"type": "external", "class": "torch.optim.lr_scheduler.StepLR", "step_size": 2, "gamma": 0.5},
    "cosine": {"type": "cosine"},
    "none": None,
}


def lrs_used(schedule: dict | None, overrides: dict[int, dict[str, float]], *, experts=(None,), steps: int = 6):
    """The LRs each optimizer step used (``OptimizerStepped.lrs``); ``overrides[step]`` is set at that step."""
    adapter = LinearAdapter(experts=experts)
    optimizer = torch.optim.SGD(adapter.param_groups())
    scheduler = None
    if schedule is not None:
        scheduler = build_scheduler(structure(SchedulerConfig, schedule), optimizer, total_steps=steps)
    bus = Bus()
    used = []

    def request(event, ctx):
        for group, lr in overrides.get(event.step, {}).items():
            ctx.control.set_lr(group, lr)

    bus.subscribe(StepStarted, request)
    bus.subscribe(OptimizerStepped, lambda e, c: used.append(e.lrs))
    Trainer(adapter=adapter, batches=linear_batches(), optimizer=optimizer, scheduler=scheduler,
            settings=LoopSettings(max_steps=steps, save_every=None), bus=bus).run()
    return used


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_set_lr_overrides_the_schedule_for_that_one_step_only(name):
    scheduled = lrs_used(SCHEDULERS[name], {})
    overridden = lrs_used(SCHEDULERS[name], {2: {"lora": 1e-6}})
    assert overridden[1] == (1e-6,)  # OptimizerStepped reports the LR the step used
    assert overridden == [*scheduled[:1], (1e-6,), *scheduled[2:]]
    assert len(set(scheduled)) > 1 or name == "none"


def test_set_lr_on_one_expert_leaves_the_other_and_restores_its_own():
    experts = ("high_noise", "low_noise")
    scheduled = lrs_used(SCHEDULERS["exponential"], {}, experts=experts)
    overridden = lrs_used(SCHEDULERS["exponential"], {3: {"low_noise": 0.5}}, experts=experts)
    assert overridden[2] == (scheduled[2][0], 0.5)
    assert overridden[:2] == scheduled[:2] and overridden[3:] == scheduled[3:]


def test_set_lr_refuses_a_group_that_does_not_exist_naming_the_valid_ones():
    adapter = LinearAdapter(experts=("high_noise", "low_noise"))
    trainer = Trainer(adapter=adapter, batches=linear_batches(), optimizer=torch.optim.SGD(adapter.param_groups()),
                      settings=LoopSettings(max_steps=1))
    with pytest.raises(ValueError, match=r"no parameter group 'lora'; the groups are 'high_noise', 'low_noise'"):
        trainer.control.set_lr("lora", 1e-4)
    trainer.control.set_lr("low_noise", 1e-4)
    assert trainer.control.take_lr_requests() == {"low_noise": 1e-4}


@pytest.mark.parametrize("lr", [math.inf, -math.inf, math.nan, -1e-4])
def test_set_lr_refuses_a_learning_rate_that_is_not_finite_and_non_negative(lr):
    control = Control()
    with pytest.raises(ValueError, match="learning rate must be a finite number >= 0"):
        control.set_lr("lora", lr)
    assert control.take_lr_requests() == {}


def test_set_lr_accepts_any_group_name_before_the_core_has_named_the_groups():
    control = Control()
    control.set_lr("anything", 0.0)
    assert control.take_lr_requests() == {"anything": 0.0}
