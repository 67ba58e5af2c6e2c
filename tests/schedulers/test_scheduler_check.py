"""Warmup rounding and ``check_scheduler``: a schedule is checked against the run's length without an optimizer."""

from __future__ import annotations

import pytest

from wantrain.core.errors import ConfigError
from wantrain.schedulers import build_scheduler, check_scheduler

from .helpers_sched import sched_cfg, two_expert_optimizer


def test_check_scheduler_raises_what_build_scheduler_raises():
    cfg = sched_cfg(type="linear", warmup_steps=40)
    with pytest.raises(ConfigError) as checked:
        check_scheduler(cfg, 40)
    with pytest.raises(ConfigError) as built:
        build_scheduler(cfg, two_expert_optimizer(), total_steps=40)
    assert str(checked.value) == str(built.value)


def test_check_scheduler_needs_no_optimizer_for_an_external_class():
    cfg = sched_cfg(type="external", **{"class": "torch.optim.lr_scheduler.StepLR"}, step_size=10, gamma=0.5)
    check_scheduler(cfg, 1)
    check_scheduler(cfg, total_steps=5000)
