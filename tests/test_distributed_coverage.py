"""Every clip once at any world size (docs/distributed.md, "Every clip once"): a sharded run (``model.parallel =
"fsdp"``) stopped mid-epoch and resumed on fewer or more ranks trains each remaining sample of the interrupted
epoch exactly once. The event log's ``BatchDrawn`` says what each step trained (every rank's clip path and frame
window); the first epoch's worth of samples it lists must be the epoch's samples, each once (before the fix a
resume 2 -> 4 ranks left half the epoch's clips untrained and trained others twice)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import test_distributed
from test_distributed import FSDP, SHARDED, only_run_dir, torchrun

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

STOP_AT = 2


def drawn(run_dir: Path) -> list[tuple[int, list[tuple[int, str, int, int]]]]:
    """(step, samples) of each ``BatchDrawn`` of the run's event log, in order."""
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [(r["step"], [tuple(s) for s in r["samples"]]) for r in records if r["_type"] == "BatchDrawn"]


def stopped(workspace: Path, name: str, ranks: int) -> Path:
    """``ranks`` ranks stopped after step 2 (rank 1 asks): the run directory."""
    done = torchrun(workspace, name, *FSDP, *SHARDED, nproc=ranks,
                    env={"WANTRAIN_PROBE_STOP_AT": str(STOP_AT), "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert done.returncode == 1 and "exitcode  : 3" in done.stderr, done.stderr[-3000:]
    return only_run_dir(workspace / name)


def resumed(workspace: Path, run_dir: Path, ranks: int, steps: int, copy: str | None = None) -> Path:
    """The run (or a copy of it) resumed on ``ranks`` ranks until step ``steps``."""
    if copy is not None:
        run_dir = Path(shutil.copytree(run_dir, workspace / copy / run_dir.name))
    done = torchrun(workspace, copy or run_dir.parent.name, *FSDP, *SHARDED, "--max-steps", str(steps),
                    "--resume", str(run_dir), nproc=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def from_two(workspace) -> Path:
    return stopped(workspace, "two", 2)


def epoch_samples(run_dir: Path) -> int:
    """Samples in an epoch: the preflight report's buckets (each clip once, no repeats in the demo data)."""
    report = json.loads((run_dir / "preflight.json").read_text())
    return sum(row["samples"] for row in report["buckets"])


def assert_each_clip_once_in_the_first_epoch(run_dir: Path, before: int, after: int) -> None:
    events = drawn(run_dir)
    assert all(rank < before for step, samples in events if step <= STOP_AT for rank, *_ in samples)
    assert {rank for step, samples in events if step > STOP_AT for rank, *_ in samples} == set(range(after))
    trained = [(path, start, frames) for _, samples in events for _, path, start, frames in samples]
    size = epoch_samples(run_dir)
    assert len(trained) >= size, (len(trained), size)  # the run reached the end of the first epoch
    first = Counter(trained[:size])
    assert len(first) == size, [s for s, n in first.items() if n > 1]  # each sample of the epoch once


def test_two_ranks_resumed_on_three_train_each_remaining_clip_once(workspace, from_two):
    assert_each_clip_once_in_the_first_epoch(resumed(workspace, from_two, 3, steps=12, copy="two_to_three"), 2, 3)


def test_two_ranks_resumed_in_one_process_train_each_remaining_clip_once(workspace, from_two):
    assert_each_clip_once_in_the_first_epoch(resumed(workspace, from_two, 1, steps=20, copy="two_to_one"), 2, 1)


def test_four_ranks_resumed_on_two_train_each_remaining_clip_once(workspace):
    run_dir = resumed(workspace, stopped(workspace, "four", 4), 2, steps=12)
    assert_each_clip_once_in_the_first_epoch(run_dir, 4, 2)
