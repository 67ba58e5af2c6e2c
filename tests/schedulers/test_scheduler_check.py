"""Warmup rounding and ``check_scheduler``: a schedule is checked against the run's length without an optimizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wantrain.app.config import load_config
from wantrain.core.errors import ConfigError
from wantrain.schedulers import build_scheduler, check_scheduler, lr_at, warmup_steps_for

from .helpers_sched import run_steps, sched_cfg, two_expert_optimizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.5, 0.9, 0.999])
def test_fractional_warmup_fits_a_run_of_any_length(fraction):
    cfg = sched_cfg(type="cosine", warmup_steps=fraction)
    for total in range(1, 400):
        check_scheduler(cfg, total)
        warmup = warmup_steps_for(cfg, total)
        nearest = int(fraction * total + 0.5)
        assert warmup == (0 if total == 1 else min(max(1, nearest), total - 1)), total
        assert lr_at(cfg, 1.0, total - 1, total) >= 0.0


def test_fractional_warmup_rounds_to_the_nearest_step_with_at_least_one_and_one_left_for_the_schedule():
    assert [warmup_steps_for(sched_cfg(warmup_steps=0.05), n) for n in (1, 2, 9, 10, 29, 30, 1000)] == [
        0, 1, 1, 1, 1, 2, 50  # 0.45 -> 1 (at least one), 0.5 -> 1, 1.45 -> 1, 1.5 -> 2
    ]
    assert [warmup_steps_for(sched_cfg(warmup_steps=0.99), n) for n in (1, 2, 10, 100)] == [0, 1, 9, 99]


def test_one_step_smoke_run_of_the_quickstart_config_has_a_valid_schedule():
    cfg = load_config(ROOT / "examples" / "quickstart.toml", ["train.max_steps=1"])
    assert isinstance(cfg.lr_scheduler.warmup_steps, float)  # the case the issue reported
    check_scheduler(cfg.lr_scheduler, cfg.train.max_steps)
    optimizer = two_expert_optimizer()
    scheduler = build_scheduler(cfg.lr_scheduler, optimizer, total_steps=1)
    assert run_steps(optimizer, scheduler, 1) == [[1e-4, 5e-5]]  # no warmup in a one-step run: the peak LR


@pytest.mark.parametrize(("warmup", "total"), [(100, 100), (250, 100), (1, 1), (5, 2), (30, 31)])
def test_integer_warmup_as_long_as_the_run_is_refused_suggesting_values_that_work(warmup, total):
    cfg = sched_cfg(type="cosine", warmup_steps=warmup)
    if warmup < total:
        check_scheduler(cfg, total)
        return
    with pytest.raises(ConfigError) as info:
        check_scheduler(cfg, total)
    message = str(info.value)
    assert message.startswith(f"lr_scheduler.warmup_steps = {warmup} leaves no step for the schedule in a run of "
                              f"{total} optimizer step")
    suggested = [float(v) if "." in v else int(v) for v in re.findall(r"warmup_steps = ([0-9.]+)", message)[1:]]
    assert suggested and any(isinstance(v, int) for v in suggested) and 0.05 in suggested, message
    for value in suggested:
        check_scheduler(sched_cfg(type="cosine", warmup_steps=value), total)


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
