"""The log interval's bookkeeping (core.interval): loss means and the non-finite guard's counters computed on the
host from one transfer, restored exactly from a checkpoint taken between log steps, and its cost on the device
(one op per optimizer step)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wantrain.core.bus import Bus
from wantrain.core.events import MetricsLogged
from wantrain.core.interval import LogInterval
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.core.settings import FaultsConfig

from .fakes import LinearAdapter, LinearBatches
from .test_guards_and_state import build


def step(interval: LogInterval, losses: list[tuple[float, str | None]], norm: float = 1.0) -> torch.Tensor:
    """One optimizer step as the loop does it: keep the micro-step losses, check them and the norm into a flag."""
    tensors = [torch.tensor(value) for value, _ in losses]
    for t, (_, expert) in zip(tensors, losses, strict=True):
        interval.add_loss(t, expert)
    flag = interval.next_flag()
    interval.check_finite([*tensors, torch.tensor(norm)], flag)
    return flag


def close(interval: LogInterval) -> dict[str, float]:
    return interval.close(torch.cat(interval.device_parts()).tolist())


def test_means_leave_non_finite_losses_out_and_flags_count_the_skipped_steps():
    interval = LogInterval("cpu", capacity=4)
    assert step(interval, [(1.0, "high_noise")]).item() == 0.0
    assert step(interval, [(math.nan, "high_noise")]).item() == 1.0
    assert step(interval, [(3.0, "low_noise")], norm=math.inf).item() == 1.0  # a finite loss, an infinite norm
    assert step(interval, [(5.0, "low_noise")]).item() == 0.0
    values = close(interval)
    assert values == {"train/loss": 3.0, "train/loss/high_noise": 1.0, "train/loss/low_noise": 4.0,
                      "train/nan_skipped_steps": 2.0, "train/nan_streak_max": 2.0}


def test_an_interval_without_a_finite_loss_logs_no_loss_and_a_streak_spans_intervals():
    interval = LogInterval("cpu", capacity=2)
    step(interval, [(1.0, None)])
    step(interval, [(math.nan, None)])
    assert close(interval) == {"train/loss": 1.0, "train/nan_skipped_steps": 1.0, "train/nan_streak_max": 1.0}
    step(interval, [(math.inf, None)])
    step(interval, [(math.nan, None)])
    # the streak began in the previous interval: three in a row; no finite loss, so no train/loss at all
    assert close(interval) == {"train/nan_skipped_steps": 3.0, "train/nan_streak_max": 3.0}
    step(interval, [(2.0, None)])
    assert close(interval)["train/nan_streak_max"] == 0.0


def test_a_longer_interval_than_its_capacity_gets_another_buffer():
    interval = LogInterval("cpu", capacity=2)
    for value in (1.0, math.nan, 2.0, math.nan, 3.0):
        step(interval, [(value, None)])
    assert close(interval) == {"train/loss": 2.0, "train/nan_skipped_steps": 2.0, "train/nan_streak_max": 1.0}


def test_state_taken_between_log_steps_restores_the_same_metrics():
    plan = [[(math.nan, "high_noise"), (0.25, "high_noise")], [(1.5, "low_noise"), (2.0, "low_noise")],
            [(0.1, "low_noise"), (0.3, "low_noise")], [(math.inf, "high_noise"), (1.0, "high_noise")]]
    whole = LogInterval("cpu", capacity=4)
    step(whole, [(math.nan, None)])
    close(whole)  # a streak of one carried into the interval below
    first = LogInterval("cpu", capacity=4)
    first.load_state_dict(whole.state_dict())
    for losses in plan[:2]:
        step(whole, losses)
        step(first, losses)
    saved = first.state_dict()
    resumed = LogInterval("cpu", capacity=4)
    resumed.load_state_dict(saved)
    for losses in plan[2:]:
        step(whole, losses)
        step(resumed, losses)
    expected = close(whole)
    assert close(resumed) == expected
    assert expected["train/nan_streak_max"] == 2.0 and expected["train/nan_skipped_steps"] == 3.0


def test_a_checkpoint_of_the_older_format_is_carried_into_the_interval():
    interval = LogInterval("cpu", capacity=4)
    sums = {"train/loss": {"total": torch.tensor(3.0), "count": torch.tensor(2.0)},
            "train/loss/high_noise": {"total": torch.tensor(3.0), "count": torch.tensor(2.0)},
            "alpha/x": {"total": torch.tensor(1.0), "count": 1}}
    guard = {"streak": torch.tensor(1.0), "streak_max": torch.tensor(1.0), "skipped": torch.tensor(4.0)}
    interval.load_legacy(guard, sums)
    assert set(sums) == {"alpha/x"}  # an observer's sums stay with the metrics
    step(interval, [(6.0, "high_noise")])
    step(interval, [(math.nan, "high_noise")])
    assert close(interval) == {"train/loss": 3.0, "train/loss/high_noise": 3.0, "train/nan_skipped_steps": 5.0,
                               "train/nan_streak_max": 1.0}


def test_a_run_resumed_inside_a_streak_logs_what_the_uninterrupted_run_logs(tmp_path):
    from wantrain.core.checkpoint import read_checkpoint

    from .test_guards_and_state import StopAt, losses

    faults = FaultsConfig(nan_at_steps=[5, 6, 7])  # a streak across the checkpoint at step 6 (log steps: 4, 8, 12)
    full, _, full_rec = build(tmp_path / "full", faults=faults, log_every=4, save_every=3)
    assert full.run().status == "completed"
    part, _, _ = build(tmp_path / "part", faults=faults, observers=[StopAt(7)], log_every=4, save_every=3)
    part.run()
    resumed, _, resumed_rec = build(tmp_path / "resumed", faults=faults, log_every=4, save_every=3)
    resumed.load_state_dict(read_checkpoint(tmp_path / "part" / "checkpoints" / "step_000006").tree)
    assert resumed.run().status == "completed"

    def logged(rec):
        return [(e.step, {k: v for k, v in e.values.items() if k != "train/step_time_s"})
                for e in rec.events if isinstance(e, MetricsLogged) and e.step > 6]

    assert logged(resumed_rec) == logged(full_rec)
    (at8,) = [v for s, v in logged(full_rec) if s == 8]
    assert at8["train/nan_streak_max"] == 3 and at8["train/nan_skipped_steps"] == 3
    assert losses(resumed_rec)[-1] == losses(full_rec)[-1]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _bare_ops(steps: int) -> int:
    """Device ops of the loop a user writes by hand (forward, backward, clip, step, loss summed on the device)."""
    adapter = LinearAdapter(experts=("high_noise", "low_noise"), switch_every=3)
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=0.05, fused=True)
    batches, generator, running = iter(LinearBatches()), torch.Generator(), None
    with OpCounter() as counter:
        for n in range(1, steps + 1):
            expert = adapter.expert_for_step(n)
            loss = adapter.loss(next(batches), expert, generator)
            loss.backward()
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            running = loss.detach() if running is None else running + loss.detach()
    return counter.ops


def _trainer_ops(steps: int) -> int:
    adapter = LinearAdapter(experts=("high_noise", "low_noise"), switch_every=3)
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=0.05, fused=True)
    trainer = Trainer(adapter=adapter, batches=LinearBatches(), optimizer=optimizer, bus=Bus(),
                      settings=LoopSettings(max_steps=steps, log_every=1000, clip_grad_norm=1.0))
    with OpCounter() as counter:
        trainer.run()
    return counter.ops


@pytest.mark.parametrize("steps", [12])
def test_the_core_adds_about_one_device_op_per_step_to_a_bare_loop(steps):
    # per step, the difference of a long and a short run (run start and the one log step cancel out)
    extra = (_trainer_ops(3 * steps) - _trainer_ops(steps)) - (_bare_ops(3 * steps) - _bare_ops(steps))
    # the guard's fused check, against the bare loop's running loss sum: no more than one op per step
    assert extra / (2 * steps) <= 1.0


def test_observers_running_means_leave_non_finite_values_out_when_asked():
    from wantrain.core.context import DeviceMetrics

    metrics = DeviceMetrics()
    for value in (1.0, math.nan, 3.0):
        metrics.accumulate("x", torch.tensor(value), finite_only=True)
        metrics.accumulate("y", torch.tensor(value))
    metrics.accumulate("z", torch.tensor(math.inf), finite_only=True)
    values = metrics.gather()
    assert values["x"] == 2.0 and math.isnan(values["y"]) and "z" not in values
