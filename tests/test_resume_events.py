"""A resumed run's event log is the uninterrupted run's: killed (SIGKILL, `[faults] kill_at_steps`) at an expert
boundary or between a checkpoint's rename and its `CheckpointSaved` event, then resumed with `--resume auto`, the
run's events.jsonl holds the same records as a run never interrupted, times and sequence numbers aside (and the
`RunStarted` that marks the join)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import prewarmed
import pytest
from inprocess import wantrain
from test_end_to_end import copy_examples

pytestmark = pytest.mark.slow

# 24 steps, experts switch every 10 (quickstart): boundaries before steps 11 and 21; checkpoints every 5
SETTINGS = ["--max-steps", "24", "--set", "checkpoint.every=5", "--set", "train.save_every=20",
            "--set", "train.log_every=2", "--set", "observers.progress=false", "--set", "observers.record_events=true"]


def run(config: Path, *extra: str) -> subprocess.CompletedProcess:
    """A run; one that is killed (``faults.kill_at_steps``) in a process of its own, the others in this one."""
    if not any(item.startswith("faults.kill_at_steps") for item in extra):
        return wantrain("run", str(config), *SETTINGS, *extra)
    return prewarmed.run(["-m", "wantrain.cli.main", "run", str(config), *SETTINGS, *extra], capture_output=True,
                         text=True, timeout=300)


def events(root: Path) -> list[dict]:
    """The run's records with what differs between processes left out: seq, wall times, timings, memory."""
    (run_dir,) = (root / "runs").iterdir()
    out = []
    for line in (run_dir / "events.jsonl").read_text().replace(str(run_dir), "<run_dir>").splitlines():
        record = json.loads(line)
        for key in ("seq", "wall_time", "elapsed_s"):
            record.pop(key, None)
        if "values" in record:
            record["values"] = {k: v for k, v in record["values"].items()
                                if "time" not in k and not k.startswith("memory/")}
        out.append(record)
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("events")
    copy_examples(tmp)
    return tmp


def fresh(workspace: Path, tmp_path: Path) -> Path:
    config = tmp_path / "quickstart.toml"
    config.write_text((workspace / "quickstart.toml").read_text()
                      .replace('output_dir = "runs"', f'output_dir = "{tmp_path / "runs"}"')
                      .replace('path = "demo_data"', f'path = "{workspace / "demo_data"}"'))
    return config


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = run(fresh(workspace, tmp))
    assert done.returncode == 0, done.stderr
    records = events(tmp)
    assert [r["step"] for r in records if r["_type"] == "ExpertSwitched"] == [11, 21]
    return records


KILLS = {
    "inside the first step after an expert boundary": ["--set", "faults.kill_at_steps=[12]"],
    "between the step-10 checkpoint's rename and its event": [
        "--set", "faults.kill_at_steps=[10]", "--set", 'faults.kill_phase="after_checkpoint"'],
}


@pytest.mark.parametrize("kill", KILLS, ids=["expert-boundary", "after-checkpoint-rename"])
def test_a_run_killed_and_resumed_records_the_same_events_as_an_uninterrupted_one(workspace, uninterrupted,
                                                                                 tmp_path, kill):
    config = fresh(workspace, tmp_path)
    killed = run(config, *KILLS[kill])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run(config, "--resume", "auto")  # without the fault: [faults] may change on resume
    assert done.returncode == 0, done.stderr
    assert "step_000010" in done.stderr  # resumed from the checkpoint before the boundary
    records = events(tmp_path)
    joins = [r for r in records if r["_type"] == "RunStarted" and r["resumed_from"]]
    assert [r["step"] for r in joins] == [10]
    assert [r for r in records if r not in joins] == uninterrupted
