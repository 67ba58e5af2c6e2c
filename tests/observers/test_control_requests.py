"""A person's requests (``ControlRequested``: ``wantrain ctl``, the page's buttons) reach the sample and validation
observers: a round at that step for their own action, nothing for another action or a refused request."""

from __future__ import annotations

from types import SimpleNamespace

from wantrain.core.bus import Bus
from wantrain.core.events import ControlRequested, MetricsLogged
from wantrain.observers.evaluation.samples import SampleVideos
from wantrain.observers.evaluation.validation import Validation


def request(action, refused=None, step=7):
    return ControlRequested(step=step, action=action, source="web", request_id="x", refused=refused)


def test_validate_now_validates_at_that_step_and_logs_the_values(monkeypatch):
    observer = Validation([], timesteps=[0.5], seed=0, every=100)
    bus, logged = Bus(), []
    bus.subscribe(MetricsLogged, lambda e, c: logged.append(e))
    observer.attach_to(bus)
    runs = []
    monkeypatch.setattr(observer, "_run", lambda step, ctx: runs.append(step) or {"val/loss": 0.5})
    ctx = SimpleNamespace(state=SimpleNamespace(expert="low_noise", total_steps=50))
    for event in (request("sample"), request("validate", refused="not under torchrun"), request("validate")):
        observer.on_control_requested(event, ctx)
    assert runs == [7]
    assert [(e.step, e.values, e.expert) for e in logged] == [(7, {"val/loss": 0.5}, "low_noise")]


def test_sample_now_runs_a_round_at_that_step(monkeypatch, tmp_path):
    observer = SampleVideos(out_dir=tmp_path, jobs=[], every=100, fps=16.0)
    rounds = []
    monkeypatch.setattr(observer, "_round", lambda step, ctx, skip=False: rounds.append((step, skip)))
    for event in (request("validate"), request("sample", refused="not under torchrun"), request("sample")):
        observer.on_control_requested(event, None)
    assert rounds == [(7, False)]
