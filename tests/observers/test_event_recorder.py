"""EventRecorder: when its records reach the disk."""

from __future__ import annotations

import json


def test_records_reach_the_file_at_every_optimizer_step_not_at_every_event(tmp_path):
    from wantrain.core.bus import Bus
    from wantrain.core.events import OptimizerStepped, StepStarted
    from wantrain.observers.event_recorder import EventRecorder

    path = tmp_path / "events.jsonl"
    bus = Bus()
    EventRecorder(path).attach_to(bus)

    def step(n: int, log: bool) -> None:
        bus.emit(StepStarted(step=n, micro_step=n, accumulation_index=1, ends_optimizer_step=True,
                             is_log_step=log, expert=None))
        bus.emit(OptimizerStepped(step=n, expert=None, skipped=False, skip_reason=None, lrs=(0.1,),
                                  group_names=("lora",), is_log_step=log))

    bus.emit(StepStarted(step=1, micro_step=1, accumulation_index=1, ends_optimizer_step=True, is_log_step=False,
                         expert=None))
    assert path.read_text() == ""  # buffered within the step: no write system call per event
    bus.emit(OptimizerStepped(step=1, expert=None, skipped=False, skip_reason=None, lrs=(0.1,),
                              group_names=("lora",), is_log_step=False))
    assert len(path.read_text().splitlines()) == 2  # a killed run keeps every finished step on record
    step(2, log=True)
    on_disk = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["_type"], r["step"]) for r in on_disk] == [
        ("StepStarted", 1), ("OptimizerStepped", 1), ("StepStarted", 2), ("OptimizerStepped", 2)]
    bus.close()


def test_non_finite_values_and_registered_events_are_recorded_exactly():
    import math

    import attrs

    from wantrain.core.events import (
        Event,
        MetricsLogged,
        OptimizerStepped,
        from_record,
        register_event_type,
        to_record,
    )
    from wantrain.core.events.log import encode_record

    @register_event_type
    @attrs.frozen(slots=True, kw_only=True)
    class ThresholdCrossed(Event):  # an observer's own event, with a float field
        level: float

    events = [
        MetricsLogged(step=4, expert=None, values={"train/loss": 0.25, "train/grad_norm": math.inf,
                                                   "train/x": math.nan}, elapsed_s=1.5, total_steps=8),
        MetricsLogged(step=8, expert="low_noise", values={"train/loss": 1 / 3}, elapsed_s=2.5, total_steps=8),
        OptimizerStepped(step=4, expert=None, skipped=False, skip_reason=None, lrs=(1e-7, 2.5e-4),
                         group_names=("a", "b"), is_log_step=True),
        ThresholdCrossed(step=5, level=math.nan),
    ]
    for seq, event in enumerate(events):
        line = encode_record(to_record(event, seq, 1764500000.123456))
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        back = from_record(json.loads(line))
        # NaN != NaN: compare the JSON of both (json writes NaN as NaN, not as null)
        assert json.dumps(attrs.asdict(back)) == json.dumps(attrs.asdict(event)), line
    line = encode_record(to_record(events[0], 0, 0.0))
    assert b'"train/x":NaN' in line and b'"train/grad_norm":Infinity' in line  # not turned into null


def test_a_checkpoint_saved_delivered_again_after_a_resume_is_recorded_once(tmp_path):
    from wantrain.core.bus import Bus
    from wantrain.core.events import CheckpointSaved, RunStarted
    from wantrain.observers.event_recorder import EventRecorder

    path = tmp_path / "events.jsonl"
    saved = CheckpointSaved(step=4, paths=(), final=False, reason="every 4 steps", checkpoint="ck/step_000004")
    bus = Bus()
    EventRecorder(path).attach_to(bus)
    bus.emit(saved)  # on record: the kill came while observers handled it
    bus.close()
    bus = Bus()
    EventRecorder(path, keep_through_step=4).attach_to(bus)
    bus.emit(RunStarted(step=4, run_dir="r", total_steps=8, grad_accum=1, experts=(None,), log_every=1,
                        resumed_from="ck/step_000004"))
    bus.emit(saved)  # delivered again by the resumed run (core.loop): not written twice
    bus.emit(CheckpointSaved(step=8, paths=(), final=True, reason="completed", checkpoint="ck/step_000008"))
    bus.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["_type"], r["step"]) for r in records] == [
        ("CheckpointSaved", 4), ("RunStarted", 4), ("CheckpointSaved", 8)]
