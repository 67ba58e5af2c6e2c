"""Each guarantee of wantrain.core.bus, tested by name."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import attrs
import blinker
import pytest
import torch

from wantrain.core.bus import Bus, Observer, Priority, on, signal_name
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import (
    CATALOGUE,
    Event,
    GradsReady,
    ObserverFailed,
    OptimizerStepped,
    RunEnded,
    StepStarted,
    register_event_type,
)
from wantrain.core.loop import LoopSettings, Trainer

from .fakes import LinearAdapter, linear_batches
from .test_loop import Recorder, make_trainer


def ended(step: int = 0) -> RunEnded:
    return RunEnded(step=step, status="completed", reason=None)


def grads_ready(step: int = 1) -> GradsReady:
    return GradsReady(step=step, is_log_step=False, expert=None)


def test_dispatch_order_is_controllers_then_sinks_then_recorder_then_subscription_order():
    bus = Bus(ctx=None)
    order: list[str] = []
    bus.subscribe(RunEnded, lambda e, c: order.append("sink-a"))
    bus.subscribe(RunEnded, lambda e, c: order.append("recorder"), priority=Priority.RECORDER)
    bus.subscribe(RunEnded, lambda e, c: order.append("controller"), priority=Priority.CONTROLLER)
    bus.subscribe(RunEnded, lambda e, c: order.append("sink-b"))
    for i in range(20):  # many handlers: a set of ids would iterate in arbitrary order
        bus.subscribe(RunEnded, lambda e, c, i=i: order.append(f"n{i}"))
    bus.emit(ended())
    assert order == ["controller", "sink-a", "sink-b", *[f"n{i}" for i in range(20)], "recorder"]


def test_strong_references_keep_a_lambda_observer_firing():
    bus = Bus(ctx=None)
    seen = []
    bus.subscribe(RunEnded, lambda e, c: seen.append(e.step))

    class Temp(Observer):
        @on(RunEnded)
        def handle(self, event, ctx):
            seen.append("temp")

    bus.attach(Temp())  # no other reference to the observer exists
    bus.signal("run_ended").connect(lambda e, ctx: seen.append("blinker"))  # blinker's default would be weak
    gc.collect()
    bus.emit(ended(7))
    assert seen == [7, "temp", "blinker"]


def test_each_bus_has_its_own_namespace_not_the_global_one():
    a, b = Bus(ctx=None), Bus(ctx=None)
    seen = []
    a.subscribe(RunEnded, lambda e, c: seen.append("a"))
    b.emit(ended())
    assert seen == []
    assert isinstance(a.namespace, blinker.Namespace) and a.namespace is not b.namespace
    assert a.signal("run_ended") is not b.signal("run_ended") and a.signal(RunEnded) is a.namespace["run_ended"]
    assert not blinker.signal("run_ended").receivers  # nothing in blinker's global namespace


def test_passive_failure_emits_observer_failed_and_training_goes_on_then_disables():
    bus = Bus(ctx=None, max_failures=2)
    failures: list[ObserverFailed] = []
    after = []

    def broken(event, ctx):
        raise ValueError("disk full")

    bus.subscribe(GradsReady, broken, name="broken")
    bus.subscribe(GradsReady, lambda e, c: after.append(e.step))
    bus.subscribe(ObserverFailed, lambda e, c: failures.append(e))
    for step in range(4):
        bus.emit(grads_ready(step))
    assert after == [0, 1, 2, 3]  # later handlers still ran every time
    assert [(f.observer, f.failures, f.disabled) for f in failures] == [("broken", 1, False), ("broken", 2, True)]
    assert "disk full" in failures[0].error


def test_critical_failure_raises_critical_observer_error():
    class Guard(Observer):
        critical = True
        priority = Priority.CONTROLLER

        @on(RunEnded)
        def handle(self, event, ctx):
            raise RuntimeError("nan loss")

    bus = Bus(ctx=None)
    bus.attach(Guard())
    with pytest.raises(CriticalObserverError, match="Guard") as info:
        bus.emit(ended())
    assert isinstance(info.value.__cause__, RuntimeError)


def test_close_runs_for_every_observer_even_when_one_close_fails():
    closed = []

    class A(Observer):
        @on(RunEnded)
        def handle(self, event, ctx): ...

        def close(self):
            closed.append("a")
            raise OSError("flush failed")

    class B(A):
        def close(self):
            closed.append("b")

    bus = Bus(ctx=None)
    bus.attach(A())
    bus.attach(B())
    bus.close()
    bus.close()  # idempotent
    assert closed == ["a", "b"]


def test_subscription_to_unknown_event_type_is_refused():
    bus = Bus(ctx=None)

    @attrs.frozen(kw_only=True)
    class NotRegistered(Event):
        pass

    with pytest.raises(TypeError, match="not a registered event type"):
        bus.subscribe(NotRegistered, lambda e, c: None)
    with pytest.raises(TypeError, match="not a registered event type"):
        bus.subscribe(dict, lambda e, c: None)  # type: ignore[arg-type]


def test_subscription_with_wrong_handler_signature_is_refused():
    bus = Bus(ctx=None)
    with pytest.raises(TypeError, match=r"must accept \(event, ctx\)"):
        bus.subscribe(RunEnded, lambda event: None)

    class Bad(Observer):
        @on(RunEnded)
        def handle(self, event): ...

    with pytest.raises(TypeError, match=r"must accept \(event, ctx\)"):
        bus.attach(Bad())


def test_observer_with_no_handlers_is_refused():
    with pytest.raises(TypeError, match="no handlers"):
        Bus(ctx=None).attach(Observer())


def test_events_emitted_inside_a_handler_are_dispatched_after_the_current_event():
    @register_event_type
    @attrs.frozen(kw_only=True)
    class Custom(Event):
        note: str

    bus = Bus(ctx=None)
    order = []

    def first(event, ctx):
        order.append("first")
        bus.emit(Custom(step=event.step, note="x"))

    bus.subscribe(GradsReady, first)
    bus.subscribe(GradsReady, lambda e, c: order.append("second"))
    bus.subscribe(Custom, lambda e, c: order.append(f"custom-{e.note}"))
    bus.emit(grads_ready())
    assert order == ["first", "second", "custom-x"]


def test_journal_sees_the_event_before_a_crashing_critical_handler():
    bus = Bus(ctx=None)
    records = []
    bus.add_journal(records.append)

    def crash(event, ctx):
        raise RuntimeError("boom")

    bus.subscribe(StepStarted, crash, critical=True)
    with pytest.raises(CriticalObserverError):
        bus.emit(StepStarted(step=1, micro_step=1, accumulation_index=1, ends_optimizer_step=True,
                             is_log_step=False, expert=None))
    assert [r["_type"] for r in records] == ["StepStarted"]
    assert records[0]["seq"] == 1 and records[0]["schema"] == 1


def _recording_bus() -> tuple[Bus, list[Event]]:
    bus = Bus(ctx=None)
    seen: list[Event] = []
    for event_type in CATALOGUE:
        bus.subscribe(event_type, lambda e, c: seen.append(e), priority=Priority.RECORDER)
    return bus, seen


def _raise(exc: BaseException):
    def handler(event, ctx):
        raise exc

    return handler


@pytest.mark.parametrize("abort", [RuntimeError("nan loss"), KeyboardInterrupt()], ids=["critical", "interrupt"])
def test_nothing_after_run_ended_a_failure_left_by_an_aborted_dispatch_comes_before_it(abort):
    bus, seen = _recording_bus()
    bus.subscribe(GradsReady, _raise(ValueError("disk full")), name="passive")
    bus.subscribe(GradsReady, _raise(abort), name="guard", critical=True)
    with pytest.raises(CriticalObserverError if isinstance(abort, Exception) else KeyboardInterrupt):
        bus.emit(grads_ready(3))
    bus.emit(ended(3))
    assert [type(e).__name__ for e in seen] == ["ObserverFailed", "RunEnded"]
    assert (seen[0].observer, seen[0].event_type, seen[0].step) == ("passive", "GradsReady", 3)


def test_nothing_after_run_ended_neither_a_failure_on_it_nor_an_event_emitted_from_it():
    @register_event_type
    @attrs.frozen(kw_only=True)
    class LateNote(Event):
        note: str

    bus, seen = _recording_bus()
    bus.subscribe(LateNote, lambda e, c: seen.append(e))
    bus.subscribe(RunEnded, _raise(OSError("flush failed")), name="writer")
    bus.subscribe(RunEnded, lambda e, c: bus.emit(LateNote(step=e.step, note="too late")))
    bus.emit(ended(5))
    bus.emit(grads_ready(6))
    assert [type(e).__name__ for e in seen] == ["RunEnded"]


def test_nothing_after_run_ended_in_a_run_a_critical_observer_aborts():
    """The issue's case: a passive observer fails on GradsReady and a critical one aborts the same dispatch."""
    bus, seen = _recording_bus()
    bus.subscribe(GradsReady, _raise(ValueError("disk full")), name="passive")
    bus.subscribe(GradsReady, _raise(RuntimeError("nan loss")), name="guard", critical=True)
    adapter = LinearAdapter()
    trainer = Trainer(adapter=adapter, batches=linear_batches(), optimizer=torch.optim.SGD(adapter.param_groups()),
                      settings=LoopSettings(max_steps=3), bus=bus)
    with pytest.raises(CriticalObserverError):
        trainer.run()
    assert [type(e).__name__ for e in seen[-3:]] == ["LossComputed", "ObserverFailed", "RunEnded"]
    assert seen[-2].event_type == "GradsReady" and seen[-1].status == "failed"


def test_an_event_nobody_receives_is_counted_and_run_ended_still_closes_dispatch():
    bus = Bus()
    seen = []
    bus.subscribe(OptimizerStepped, lambda e, c: seen.append(e.step))
    bus.emit(StepStarted(step=1, micro_step=1, accumulation_index=1, ends_optimizer_step=True, is_log_step=False,
                         expert=None))  # no receiver: the fast path
    bus.emit(OptimizerStepped(step=1, expert=None, skipped=False, skip_reason=None, lrs=(0.1,),
                              group_names=("lora",), is_log_step=False))
    bus.emit(RunEnded(step=1, status="completed", reason=None))  # no receiver either: still the last event
    bus.emit(OptimizerStepped(step=2, expert=None, skipped=False, skip_reason=None, lrs=(0.1,),
                              group_names=("lora",), is_log_step=False))
    assert seen == [1]
    assert bus.emitted == 3


def test_wants_says_whether_an_event_would_reach_a_handler_or_a_journal():
    from wantrain.core.events import GradsReady, StepStarted

    bus = Bus()
    assert not bus.wants(StepStarted)
    bus.subscribe(GradsReady, lambda e, ctx: None)
    assert bus.wants(GradsReady) and not bus.wants(StepStarted)
    bus.add_journal(lambda record: None)
    assert bus.wants(StepStarted)


# -- the signals: blinker's API on the bus ---------------------------------------------------------------------------
def test_each_event_type_has_a_signal_named_as_the_design_names_it():
    names = {event_type.__name__: signal_name(event_type) for event_type in CATALOGUE}
    assert {names[n] for n in ("StepStarted", "LossComputed", "GradsReady", "CheckpointSaved")} == {
        "step_start", "loss_computed", "grads_ready", "checkpoint_saved"}  # the design's four, as written
    assert names["OptimizerStepped"] == "optimizer_stepped" and names["OutOfMemory"] == "out_of_memory"
    assert len(set(names.values())) == len(CATALOGUE)
    bus = Bus()
    for event_type in CATALOGUE:
        signal = bus.signal(signal_name(event_type))
        assert isinstance(signal, blinker.NamedSignal) and signal.name == signal_name(event_type)
        assert bus.signal(event_type) is signal

    @register_event_type
    @attrs.frozen(kw_only=True)
    class LRChanged(Event):
        lr: float

    assert signal_name(LRChanged) == "lr_changed" and bus.signal("lr_changed") is bus.signal(LRChanged)


def test_emit_sends_through_the_events_blinker_signal():
    bus = Bus()
    seen = []
    bus.subscribe(GradsReady, lambda e, c: seen.append(e.step))
    signal = bus.signal("grads_ready")
    sent = []
    signal.send = lambda event, **kwargs: sent.append((event.step, kwargs)) or blinker.NamedSignal.send(
        signal, event, **kwargs)  # what Bus.emit calls
    bus.ctx = "the context"
    bus.emit(grads_ready(1))
    with signal.muted():  # blinker's own switch silences the bus's dispatch of this event
        bus.emit(grads_ready(2))
    bus.emit(grads_ready(3))
    assert sent == [(1, {"ctx": "the context"}), (2, {"ctx": "the context"}), (3, {"ctx": "the context"})]
    assert seen == [1, 3]


def test_a_function_connected_through_the_blinker_signal_receives_events_in_the_documented_order():
    bus = Bus()
    rec = bus.attach(Recorder())  # an observer, the other way to subscribe, sees the same run
    names: list[str] = []
    grads_order: list[str] = []

    def record(event, ctx):
        names.append(signal_name(type(event)))

    for event_type in CATALOGUE:
        bus.signal(signal_name(event_type)).connect(record)
    bus.signal("grads_ready").connect(lambda e, ctx: grads_order.append("recorder"), priority=Priority.RECORDER)

    @bus.signal("grads_ready").connect
    def sink(event, ctx):
        grads_order.append("sink")

    class Controller(Observer):  # attached last, runs first
        priority = Priority.CONTROLLER

        @on(GradsReady)
        def grads(self, event, ctx):
            grads_order.append("controller")

    bus.attach(Controller())
    make_trainer(bus=bus, max_steps=3, grad_accum=1, log_every=2, save_every=2).run()
    step = ["step_start", "loss_computed", "grads_ready", "optimizer_stepped"]
    assert names == ["run_started", *step, *step, "metrics_logged", "checkpoint_saved",
                     *step, "metrics_logged", "checkpoint_saved", "run_ended"]
    assert names == [signal_name(type(e)) for e in rec.events]
    assert grads_order == ["controller", "sink", "recorder"] * 3


def test_a_function_connected_through_blinker_follows_the_error_policy_and_disconnects():
    bus = Bus(max_failures=2)
    failures: list[ObserverFailed] = []
    bus.signal("observer_failed").connect(lambda e, ctx: failures.append(e))
    seen = []

    @bus.signal("grads_ready").connect
    def broken(event, ctx):
        raise ValueError("disk full")

    def counting(event, ctx):
        seen.append(event.step)

    with bus.signal("grads_ready").connected_to(counting):  # blinker's temporary connection
        for step in range(3):
            bus.emit(grads_ready(step))
    bus.emit(grads_ready(3))
    assert seen == [0, 1, 2]  # ran after the failing receiver every time, and not after disconnection
    assert [(f.observer, f.failures, f.disabled) for f in failures] == [
        ("test_a_function_connected_through_blinker_follows_the_error_policy_and_disconnects.<locals>.broken", 1,
         False), (failures[0].observer, 2, True)]
    assert not bus.signal("grads_ready").receivers  # disabled: disconnected from its signal
    bus.signal("run_ended").connect(_raise(RuntimeError("nan loss")), name="guard", critical=True)
    with pytest.raises(CriticalObserverError, match="guard"):
        bus.emit(ended())


def test_connecting_weakly_to_a_sender_or_to_an_unknown_signal_is_refused():
    bus = Bus()
    with pytest.raises(TypeError, match="strongly"):
        bus.signal("grads_ready").connect(lambda e, ctx: None, weak=True)
    with pytest.raises(TypeError, match="sent with the event as the sender"):
        bus.signal("grads_ready").connect(lambda e, ctx: None, sender="trainer")
    with pytest.raises(TypeError, match=r"must accept \(event, ctx\)"):
        bus.signal("grads_ready").connect(lambda sender: None)
    with pytest.raises(TypeError, match="no registered event type has the signal 'grads_redy'.*grads_ready"):
        bus.signal("grads_redy")
    assert not bus.wants(GradsReady)


def test_the_plain_function_example_in_the_observer_guide_runs(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "observers.md").read_text()
    block = re.search(r"<!-- signal-example:start -->\n```python\n(.*?)```\n<!-- signal-example:end -->", text, re.S)
    namespace: dict = {}
    exec(compile(block[1], "docs/observers.md", "exec"), namespace)
    make_trainer(bus=namespace["bus"], max_steps=3, grad_accum=2, log_every=2, save_every=2).run()
    assert namespace["running"]["micro_steps"] == 6 and torch.is_tensor(namespace["running"]["loss"])
    out = capsys.readouterr().out
    assert "step 2: saved lora_2.safetensors" in out and "step 3: saved lora_3_final.safetensors" in out
    assert out.rstrip().endswith("run completed after 3 steps")


def test_attaching_an_observer_twice_closes_it_once():
    closed = []

    class Once(Observer):
        @on(RunEnded)
        def handle(self, event, ctx):
            pass

        def close(self):
            closed.append(1)

    bus = Bus(ctx=None)
    observer = Once()
    assert bus.attach(observer) is bus.attach(observer)
    bus.close()
    assert closed == [1]


def test_events_emitted_during_an_aborted_dispatch_are_delivered_and_recorded_before_the_next_event():
    bus = Bus(ctx=None)
    records = []
    bus.add_journal(records.append)
    bus.subscribe(GradsReady, lambda e, c: bus.emit(ObserverFailed(step=e.step, observer="x", event_type="y",
                                                                   error="z", failures=1, disabled=False)),
                  priority=Priority.CONTROLLER)
    bus.subscribe(GradsReady, _raise(RuntimeError("boom")), critical=True)
    with pytest.raises(CriticalObserverError):
        bus.emit(grads_ready(3))
    bus.emit(ended(3))  # what the trainer emits next: the queued event reaches the journal first
    assert [r["_type"] for r in records] == ["GradsReady", "ObserverFailed", "RunEnded"]
