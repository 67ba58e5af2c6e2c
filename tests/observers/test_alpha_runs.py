"""The alpha controller in real runs of the tiny model (`wantrain run`): transitions reach the event log and replay
exactly, a resume across a transition matches the uninterrupted run bitwise, checkpoints carry the seed's sidecar,
and a disabled schedule changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wantrain.cli.main import main
from wantrain.core.events import MetricsLogged
from wantrain.core.events.log import read_events
from wantrain.observers.alpha.config import AlphaScheduleConfig
from wantrain.observers.alpha.controller import AlphaChanged, AlphaPolicy

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

BASE = """
[run]
output_dir = "runs"
name = "alpha"
seed = 0
[model]
variant = "tiny-t2v"
switch_every = 5
gradient_checkpointing = false
[lora]
rank = 4
[data]
path = "demo_data"
[train]
max_steps = {steps}
log_every = 5
[optimizer]
lr = 2e-3
[lr_scheduler]
type = "constant"
[observers]
progress = false
tensorboard = false
record_events = true
[checkpoint]
every = 5
keep_last = 100
"""

SCHEDULE = """
[lora.alpha_schedule]
enabled = {enabled}
window = 10
min_samples = 5
[[lora.alpha_schedule.phases]]
name = "foundation"
alpha = 4
min_steps = 10
loss_improvement_rate_below = 1000.0
max_loss_cv = 10.0
min_gradient_stability = 0.0
[[lora.alpha_schedule.phases]]
name = "balance"
alpha = 7
min_steps = 10
loss_improvement_rate_below = 1000.0
max_loss_cv = 10.0
min_gradient_stability = 0.0
[[lora.alpha_schedule.phases]]
name = "emphasis"
alpha = 10
"""


def _setup(tmp: Path, steps: int, schedule: str | None) -> Path:
    shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    config = tmp / "run.toml"
    config.write_text(BASE.format(steps=steps) + (schedule or ""), encoding="utf-8")
    return config


def _run(config: Path, *args: str) -> Path:
    assert main(["run", str(config), *args]) == 0
    (run_dir,) = (config.parent / "runs").iterdir()
    return run_dir


def _loras(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted(run_dir.glob("alpha_*_noise.safetensors"))}


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("alpha_run")
    return _run(_setup(tmp, 30, SCHEDULE.format(enabled="true")))


def test_transitions_are_logged_and_replay_through_a_fresh_policy(scheduled_run):
    events = read_events(scheduled_run / "events.jsonl")
    changed = [e for e in events if isinstance(e, AlphaChanged)]
    # each expert's 10th step: high_noise trains steps 1-5, 11-15, ...; low_noise 6-10, 16-20, ...
    assert [(e.step, e.expert, e.to_phase, e.to_alpha) for e in changed] == [
        (15, "high_noise", "balance", 7.0), (20, "low_noise", "balance", 7.0)]
    schedule = AlphaScheduleConfig(**{**_schedule_fields(scheduled_run)})
    policy = AlphaPolicy(schedule, ("high_noise", "low_noise"))
    replayed = [t for e in events if isinstance(e, MetricsLogged) for t in policy.observe(e.step, e.values)]
    assert [AlphaChanged(**t) for t in replayed] == changed


def _schedule_fields(run_dir: Path) -> dict:
    import tomllib

    from wantrain.core.config import check_value

    plain = tomllib.loads((run_dir / "config.toml").read_text())["lora"]["alpha_schedule"]
    return {**plain, "phases": check_value(AlphaScheduleConfig, "phases", plain["phases"], "phases")}


def test_run_writes_the_seed_metrics_the_alpha_series_and_a_sidecar_per_checkpoint(scheduled_run):
    lines = [json.loads(x) for x in (scheduled_run / "alpha_metrics.jsonl").read_text().splitlines()]
    assert {"step", "expert", "phase", "steps_in_phase", "conv_alpha", "linear_alpha", "loss_slope", "loss_r2",
            "loss_cv", "gradient_stability", "loss_samples"} <= set(lines[0])
    assert [(x["step"], x["phase"], x["linear_alpha"]) for x in lines if x["expert"] == "high_noise"] == [
        (5, "foundation", 4.0), (15, "foundation", 4.0), (25, "balance", 7.0)]
    metrics = [json.loads(x) for x in (scheduled_run / "metrics.jsonl").read_text().splitlines()]
    # the phase in force during each interval; the run is in phase 1 once low_noise moved on at step 20
    assert [m["alpha/phase"] for m in metrics] == [0, 0, 0, 0, 1, 1]
    sidecar = scheduled_run / "checkpoints" / "step_000020" / "step_000020_alpha_scheduler.json"
    state = json.loads(sidecar.read_text())
    assert state["experts"]["low_noise"]["phase"] == "balance" and len(state["transition_history"]) == 2
    assert len(state["experts"]["high_noise"]["losses"]) == 10
    # the exported LoRA carries the alpha in force
    high = load_file(scheduled_run / "alpha_high_noise.safetensors")
    assert {float(v) for k, v in high.items() if k.endswith(".alpha")} == {7.0}


def test_a_run_resumed_before_a_transition_matches_the_uninterrupted_run_bitwise(scheduled_run, tmp_path):
    copy = tmp_path / scheduled_run.name
    shutil.copytree(scheduled_run, copy)  # the same config and data; the continuation is written into the copy
    config = scheduled_run.parents[1] / "run.toml"
    assert main(["run", str(config), "--resume", str(copy / "checkpoints" / "step_000010")]) == 0
    original, resumed = _loras(scheduled_run), _loras(copy)
    assert original.keys() == resumed.keys() and len(original) == 2
    for name in original:
        for key, tensor in original[name].items():
            assert torch.equal(tensor, resumed[name][key]), (name, key)
    again = [e for e in read_events(copy / "events.jsonl") if isinstance(e, AlphaChanged)]
    assert again == [e for e in read_events(scheduled_run / "events.jsonl") if isinstance(e, AlphaChanged)]
    assert (copy / "alpha_metrics.jsonl").read_text().count("\n") == 6  # cut back to step 10, then continued


def test_a_disabled_schedule_trains_bitwise_like_no_schedule_and_writes_no_alpha_file(tmp_path):
    plain = _run(_setup(tmp_path / "plain", 10, None))
    disabled = _run(_setup(tmp_path / "disabled", 10, SCHEDULE.format(enabled="false")))
    a, b = _loras(plain), _loras(disabled)
    assert a.keys() == b.keys() and len(a) == 2
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])
    assert not (disabled / "alpha_metrics.jsonl").exists()
    assert not list(disabled.rglob("*_alpha_scheduler.json"))
    assert "alpha/phase" not in (disabled / "metrics.jsonl").read_text()
