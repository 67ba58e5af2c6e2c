"""The run's request inbox (core.inbox) and the loop's fixed point that reads it."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from wantrain.core import inbox as inbox_module
from wantrain.core.bus import Bus
from wantrain.core.events import CATALOGUE, CheckpointSaved, ControlRequested, OptimizerStepped, RunEnded
from wantrain.core.inbox import INBOX_NAME, Inbox, post_request
from wantrain.core.loop import LoopSettings, Trainer

from .fakes import LinearAdapter, linear_batches


class ListSaver:
    def save(self, step, final):
        return [f"lora_{step}.safetensors"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_requests_written_before_the_run_started_are_not_read(tmp_path):
    post_request(tmp_path, "stop", "ctl")
    clock = Clock()
    inbox = Inbox(tmp_path, every_s=0.0, clock=clock)
    assert inbox.poll() == []
    post_request(tmp_path, "save", "web")
    assert [(r.action, r.source, r.error) for r in inbox.poll()] == [("save", "web", None)]
    assert inbox.poll() == []


def test_the_inbox_is_looked_at_only_every_check_interval(tmp_path):
    clock = Clock()
    inbox = Inbox(tmp_path, every_s=1.0, clock=clock)
    post_request(tmp_path, "save", "ctl")
    clock.now = 0.5
    assert inbox.poll() == []
    clock.now = 1.0
    assert [r.action for r in inbox.poll()] == ["save"]


def test_a_line_being_written_waits_for_its_end_and_bad_lines_name_what_is_wrong(tmp_path):
    inbox = Inbox(tmp_path, every_s=0.0)
    with (tmp_path / INBOX_NAME).open("ab") as fh:
        fh.write(b'{"action": "save", "source": "x", "id": "1"}\n{"action": "st')
    assert [r.action for r in inbox.poll()] == ["save"]
    with (tmp_path / INBOX_NAME).open("ab") as fh:
        fh.write(b'op", "id": "2"}\nnot json\n{"action": "format-disk"}\n')
    requests = inbox.poll()
    assert requests[0].action == "stop" and requests[0].error is None
    assert requests[1].error == "not JSON"
    assert "unknown action 'format-disk'" in requests[2].error


def test_post_request_refuses_an_unknown_action_and_a_symlink_in_place_of_the_inbox(tmp_path):
    with pytest.raises(ValueError, match="unknown request 'explode'"):
        post_request(tmp_path, "explode", "ctl")
    outside = tmp_path / "outside.txt"
    outside.write_text("")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(outside, run_dir / INBOX_NAME)
    with pytest.raises(OSError) as caught:
        post_request(run_dir, "save", "ctl")
    assert caught.value.errno == errno.ELOOP
    assert outside.read_text() == ""


def test_control_requested_is_in_the_catalogue():
    assert ControlRequested in CATALOGUE


def _run_with_request(tmp_path, monkeypatch, action, at_step, max_steps=6):
    monkeypatch.setattr(inbox_module, "CHECK_EVERY_S", 0.0)
    events = []
    bus = Bus()
    bus.subscribe(OptimizerStepped, lambda e, c: post_request(tmp_path, action, "test") if e.step == at_step else None)
    for kind in (ControlRequested, CheckpointSaved, RunEnded):
        bus.subscribe(kind, lambda e, c: events.append(e))
    adapter = LinearAdapter()
    optimizer = torch.optim.SGD(adapter.param_groups(), lr=0.05)
    trainer = Trainer(adapter=adapter, batches=linear_batches(), optimizer=optimizer, run_dir=tmp_path,
                      settings=LoopSettings(max_steps=max_steps, grad_accum=1, log_every=2, save_every=None),
                      bus=bus, saver=ListSaver())
    return trainer.run(), events


def test_a_save_request_is_recorded_and_saves_after_that_step(tmp_path, monkeypatch):
    result, events = _run_with_request(tmp_path, monkeypatch, "save", at_step=3)
    assert result.status == "completed"
    kinds = [(type(e).__name__, e.step) for e in events]
    assert kinds[:2] == [("ControlRequested", 3), ("CheckpointSaved", 3)]
    assert events[0].action == "save" and events[0].source == "test" and events[0].refused is None
    assert events[1].reason == "requested (test)" and not events[1].final


def test_a_stop_request_ends_the_run_stopped_with_a_final_save(tmp_path, monkeypatch):
    result, events = _run_with_request(tmp_path, monkeypatch, "stop", at_step=2)
    assert result.status == "stopped" and result.steps == 2 and result.reason == "requested (test)"
    assert [(type(e).__name__, e.step) for e in events] == [
        ("ControlRequested", 2), ("CheckpointSaved", 2), ("RunEnded", 2)]
    assert events[1].final


def test_a_trainer_without_a_run_dir_reads_no_inbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    post_request(tmp_path, "stop", "ctl")  # in the working directory: not this run's
    adapter = LinearAdapter()
    trainer = Trainer(adapter=adapter, batches=linear_batches(),
                      optimizer=torch.optim.SGD(adapter.param_groups(), lr=0.05),
                      settings=LoopSettings(max_steps=2, grad_accum=1, log_every=1))
    assert trainer.run().status == "completed"


def test_the_run_log_says_each_request_and_warns_of_a_refused_one():
    from structlog.testing import capture_logs

    from wantrain.observers.run_log import RunLog

    with capture_logs() as logs:
        RunLog().requested(ControlRequested(step=4, action="save", source="web", request_id="a"), None)
        RunLog().requested(ControlRequested(step=5, action="sample", source="ctl", request_id="b",
                                            refused="not under torchrun"), None)
    assert [(e["event"], e["log_level"], e["action"]) for e in logs] == [
        ("request", "info", "save"), ("request_refused", "warning", "sample")]
    assert logs[1]["reason"] == "not under torchrun"


def test_a_deeply_nested_or_huge_line_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch):
    inbox = Inbox(tmp_path, every_s=0.0)
    with (tmp_path / INBOX_NAME).open("ab") as fh:  # a RecursionError in json.loads ended the run before
        fh.write(b"[" * 3000 + b"\n" + b"[" * 100_000 + b"\n")
        fh.write(b'{"action": "save", "source": "x", "id": "[[[[[[{{{{"}\n')  # brackets in a string count not
    requests = inbox.poll()
    assert [r.error for r in requests] == ["nested deeper than 4 levels", "a line of 100000 bytes (at most 4096)",
                                           None]
    monkeypatch.setattr(inbox_module, "CHECK_EVERY_S", 0.0)
    bus = Bus()
    events = []
    bus.subscribe(ControlRequested, lambda e, c: events.append(e))

    def write_at_step_2(event, ctx):
        if event.step == 2:
            with (tmp_path / INBOX_NAME).open("ab") as fh:
                fh.write(b"[" * 100_000 + b"\n")
            post_request(tmp_path, "stop", "ctl")

    bus.subscribe(OptimizerStepped, write_at_step_2)
    adapter = LinearAdapter()
    trainer = Trainer(adapter=adapter, batches=linear_batches(), run_dir=tmp_path, bus=bus, saver=ListSaver(),
                      optimizer=torch.optim.SGD(adapter.param_groups(), lr=0.05),
                      settings=LoopSettings(max_steps=6, grad_accum=1, log_every=2, save_every=None))
    result = trainer.run()
    assert result.status == "stopped" and result.steps == 2
    assert [(e.action, e.refused) for e in events] == [("", "a line of 100000 bytes (at most 4096)"),
                                                          ("stop", None)]
