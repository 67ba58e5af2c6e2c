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
