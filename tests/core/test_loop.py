"""The training loop's event protocol and control points, on a tiny linear stand-in model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from wantrain.core.bus import Bus, Observer, Priority, on
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import (
    CATALOGUE,
    GradsReady,
    LossComputed,
    MetricsLogged,
    OptimizerStepped,
    RunEnded,
    StepStarted,
)
from wantrain.core.loop import LoopSettings, Trainer

from .fakes import LinearAdapter, linear_batches


class Recorder(Observer):
    priority = Priority.RECORDER

    def __init__(self) -> None:
        self.events = []

    def handlers(self):
        for event_type in CATALOGUE:
            yield event_type, self.record

    def record(self, event, ctx):
        self.events.append(event)


class ListSaver:
    def __init__(self):
        self.saves = []

    def save(self, step, final):
        self.saves.append((step, final))
        return [f"lora_{step}{'_final' if final else ''}.safetensors"]


def make_trainer(adapter=None, bus=None, saver=None, **settings):
    adapter = adapter or LinearAdapter()
    optimizer = torch.optim.SGD(adapter.param_groups(), lr=0.05)
    defaults = dict(max_steps=3, grad_accum=2, log_every=2, save_every=2)
    defaults.update(settings)
    return Trainer(adapter=adapter, batches=linear_batches(), optimizer=optimizer,
                   settings=LoopSettings(**defaults), bus=bus or Bus(), saver=saver or ListSaver())


def signature(event):
    name = type(event).__name__
    if isinstance(event, StepStarted | LossComputed):
        return (name, event.step, event.micro_step, event.ends_optimizer_step)
    if isinstance(event, OptimizerStepped):
        return (name, event.step, event.skipped)
    if hasattr(event, "final"):
        return (name, event.step, event.final)
    return (name, event.step)


def test_golden_event_sequence_with_gradient_accumulation():
    rec = Recorder()
    bus = Bus()
    bus.attach(rec)
    result = make_trainer(bus=bus).run()
    assert result.status == "completed" and result.steps == 3
    assert [signature(e) for e in rec.events] == [
        ("RunStarted", 0),
        ("StepStarted", 1, 1, False), ("LossComputed", 1, 1, False),
        ("StepStarted", 1, 2, True), ("LossComputed", 1, 2, True),
        ("GradsReady", 1), ("OptimizerStepped", 1, False),
        ("StepStarted", 2, 3, False), ("LossComputed", 2, 3, False),
        ("StepStarted", 2, 4, True), ("LossComputed", 2, 4, True),
        ("GradsReady", 2), ("OptimizerStepped", 2, False), ("MetricsLogged", 2),
        ("CheckpointSaved", 2, False),
        ("StepStarted", 3, 5, False), ("LossComputed", 3, 5, False),
        ("StepStarted", 3, 6, True), ("LossComputed", 3, 6, True),
        ("GradsReady", 3), ("OptimizerStepped", 3, False), ("MetricsLogged", 3),
        ("CheckpointSaved", 3, True),
        ("RunEnded", 3),
    ]
    assert rec.events[-1].status == "completed"


def test_every_step_event_names_its_expert_and_experts_alternate():
    rec = Recorder()
    bus = Bus()
    bus.attach(rec)
    adapter = LinearAdapter(experts=("high_noise", "low_noise"), switch_every=2)
    make_trainer(adapter=adapter, bus=bus, max_steps=5, grad_accum=1, save_every=None).run()
    stepped = [(e.step, e.expert) for e in rec.events if isinstance(e, OptimizerStepped)]
    assert stepped == [(1, "high_noise"), (2, "high_noise"), (3, "low_noise"), (4, "low_noise"), (5, "high_noise")]
    switches = [(e.step, e.previous, e.expert) for e in rec.events if type(e).__name__ == "ExpertSwitched"]
    assert switches == [(3, "high_noise", "low_noise"), (5, "low_noise", "high_noise")]
    assert adapter.activated == ["high_noise", "low_noise", "high_noise"]
    logged = [e for e in rec.events if isinstance(e, MetricsLogged)]
    assert "train/loss/high_noise" in logged[0].values and "train/lr/low_noise" in logged[0].values


def test_metrics_logged_carries_mean_loss_of_the_interval_as_host_floats():
    losses, logged = [], []
    bus = Bus()
    bus.subscribe(LossComputed, lambda e, c: losses.append(c.live.loss.clone()))
    bus.subscribe(MetricsLogged, lambda e, c: logged.append(e))
    make_trainer(bus=bus, max_steps=4, grad_accum=1, log_every=2, save_every=None).run()
    assert [e.step for e in logged] == [2, 4]
    assert logged[0].values["train/loss"] == pytest.approx(float(torch.stack(losses[:2]).mean()), rel=1e-6)
    assert logged[1].values["train/loss"] == pytest.approx(float(torch.stack(losses[2:]).mean()), rel=1e-6)
    assert all(type(v) is float for v in logged[1].values.values())


def test_stop_request_is_sticky_and_ends_the_run_with_a_final_save():
    saver = ListSaver()
    bus = Bus()

    def stop_at_2(event, ctx):
        if event.step == 2:
            ctx.control.request_stop("enough")

    bus.subscribe(OptimizerStepped, stop_at_2)
    ended = []
    bus.subscribe(RunEnded, lambda e, c: ended.append(e))
    result = make_trainer(bus=bus, saver=saver, max_steps=10, save_every=None).run()
    assert result.steps == 2 and result.status == "stopped" and result.reason == "enough"
    assert saver.saves == [(2, True)]
    assert ended[0].status == "stopped"


def test_skip_request_leaves_parameters_unchanged_and_scheduler_still_steps():
    adapter = LinearAdapter()
    before = [p.detach().clone() for p in adapter.trainable_parameters()]
    bus = Bus()
    bus.subscribe(GradsReady, lambda e, c: c.control.skip_optimizer_step("test"))
    trainer = make_trainer(adapter=adapter, bus=bus, max_steps=2, save_every=None)
    sched = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
    trainer.scheduler = sched
    result = trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(before, adapter.trainable_parameters(), strict=True))
    assert result.steps == 2 and sched.last_epoch == 2
    assert trainer.state.skipped_steps == 2


def test_set_lr_applies_to_the_named_group_at_the_next_optimizer_step():
    bus = Bus()
    used = []
    bus.subscribe(StepStarted, lambda e, c: c.control.set_lr("lora", 0.125 * e.step))
    bus.subscribe(OptimizerStepped, lambda e, c: used.append(e.lrs))
    make_trainer(bus=bus, max_steps=3, grad_accum=1, save_every=None).run()
    assert used == [(0.125,), (0.25,), (0.375,)]


def test_out_of_memory_skips_the_step_and_stops_after_the_limit():
    rec = Recorder()
    bus = Bus()
    bus.attach(rec)
    adapter = LinearAdapter(oom_at_micro_steps=(2, 3, 4, 5))
    saver = ListSaver()
    result = make_trainer(adapter=adapter, bus=bus, saver=saver, max_steps=10, grad_accum=1,
                          max_consecutive_oom=3, save_every=None).run()
    ooms = [e for e in rec.events if type(e).__name__ == "OutOfMemory"]
    assert [(e.step, e.consecutive, e.phase) for e in ooms] == [(2, 1, "forward"), (3, 2, "forward"),
                                                                (4, 3, "forward")]
    assert result.status == "failed" and "out of memory on 3 optimizer steps in a row" in result.reason
    assert saver.saves == []  # a failed run keeps what was saved before and writes nothing new
    stepped = [(e.step, e.skipped, e.skip_reason) for e in rec.events if isinstance(e, OptimizerStepped)]
    assert stepped[1:] == [(2, True, "out of memory"), (3, True, "out of memory"), (4, True, "out of memory")]


def test_critical_observer_failure_stops_cleanly_runs_close_and_reraises():
    closed, ended = [], []

    class Guard(Observer):
        critical = True

        @on(OptimizerStepped)
        def check(self, event, ctx):
            if event.step == 2:
                raise RuntimeError("loss is nan")

        def close(self):
            closed.append(True)

    bus = Bus()
    bus.attach(Guard())
    bus.subscribe(RunEnded, lambda e, c: ended.append(e))
    saver = ListSaver()
    with pytest.raises(CriticalObserverError, match="loss is nan"):
        make_trainer(bus=bus, saver=saver, max_steps=5).run()
    assert closed == [True]
    assert ended[0].status == "failed" and "loss is nan" in ended[0].reason
    assert saver.saves == []


def test_close_runs_after_a_crash_in_the_model():
    closed = []

    class Sink(Observer):
        @on(RunEnded)
        def handle(self, event, ctx): ...

        def close(self):
            closed.append(True)

    class Broken(LinearAdapter):
        def loss(self, batch, expert, generator):
            raise ValueError("shape mismatch")

    bus = Bus()
    bus.attach(Sink())
    with pytest.raises(ValueError, match="shape mismatch"):
        make_trainer(adapter=Broken(), bus=bus).run()
    assert closed == [True]


def test_no_event_keeps_a_device_tensor_alive_after_dispatch():
    kept = []
    bus = Bus()
    bus.subscribe(LossComputed, lambda e, c: kept.append(weakref.ref(c.live.loss)))
    events = []
    bus.subscribe(RunEnded, lambda e, c: events.append(e))
    make_trainer(bus=bus, max_steps=2).run()
    gc.collect()
    assert kept and all(ref() is None for ref in kept)


def test_trainer_is_garbage_collected_after_a_run():
    bus = Bus()
    bus.subscribe(MetricsLogged, lambda e, c: None)
    trainer = make_trainer(bus=bus)
    trainer.run()
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ref() is None


def test_the_linear_stand_in_learns():
    logged = []
    bus = Bus()
    bus.subscribe(MetricsLogged, lambda e, c: logged.append(e.values["train/loss"]))
    make_trainer(bus=bus, max_steps=40, grad_accum=1, log_every=10, save_every=None).run()
    assert logged[-1] < logged[0] * 0.5
