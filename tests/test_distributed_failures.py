"""No rank waits forever (``core.parallel.failures``, docs/distributed.md "When a rank fails"): under a layout whose
forward exchanges with the other ranks (``model.parallel = "fsdp"``, ``model.sequence_degree = 2``) an
out-of-memory error on rank 1 alone ends both ranks within seconds, each with one line naming rank 1, the cause
and the checkpoint to resume from; the run then resumes from it. (Data parallel and expert groups skip such a step
together: tests/test_distributed.py, tests/test_expert_groups_run.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import test_distributed
from test_distributed import FSDP, SHARDED, only_run_dir, torchrun

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

ENDS_WITHIN_S = 60.0
"""The issue's bound for every rank to exit after the fault, on gloo (measured: see docs/distributed.md)."""

OOM_AT_3 = ["--set", "faults.oom_at_steps=[3]"]  # after FSDP's settings (which switch the faults off): rank 1 only
ULYSSES = ["--set", "model.sequence_degree=2", "--set", "data.resolutions=[32]"]  # even token counts per clip


def failed_and_resumed(workspace: Path, name: str, layout: list[str]) -> tuple[str, float, Path]:
    """Rank 1 runs out of memory at step 3 (a checkpoint at step 2); then the run resumes without the fault."""
    started = time.monotonic()
    failed = torchrun(workspace, name, *FSDP, *layout, *OOM_AT_3)
    took = time.monotonic() - started
    assert failed.returncode != 0, failed.stderr[-3000:]
    run_dir = only_run_dir(workspace / name)
    resumed = torchrun(workspace, name, *FSDP, *layout, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return failed.stderr, took, run_dir


def assert_one_line_per_rank(stderr: str, run_dir: Path, layout: str) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("wantrain run: error: rank 1 failed: out of "
                                                                     "memory at step 3")]
    assert len(lines) == 2, stderr[-3000:]  # rank 1's own line and rank 0's, ended by its watch
    for line in lines:
        assert layout in line
        assert f"resume from '{run_dir / 'checkpoints' / 'step_000002'}' (step 2) with --resume auto" in line
    assert "]: Traceback" not in stderr  # no rank's traceback ("[rank0]: Traceback"; torchrun's own stays)


def test_an_out_of_memory_error_on_one_fsdp_rank_ends_both_ranks_and_the_run_resumes(workspace):
    stderr, took, run_dir = failed_and_resumed(workspace, "fsdp_oom", SHARDED)
    assert_one_line_per_rank(stderr, run_dir, 'model.parallel = "fsdp"')
    assert took < ENDS_WITHIN_S + 30  # the launch's start included (~20 s on 2 cores)
    assert (run_dir / "checkpoints" / "step_000004").is_dir()  # resumed from step 2, trained on to the end


def test_an_out_of_memory_error_on_one_ulysses_rank_ends_both_ranks_and_the_run_resumes(workspace):
    stderr, took, run_dir = failed_and_resumed(workspace, "ulysses_oom", ULYSSES)
    assert_one_line_per_rank(stderr, run_dir, "model.sequence_degree > 1")
    assert took < ENDS_WITHIN_S + 30
    assert (run_dir / "checkpoints" / "step_000004").is_dir()


def test_data_parallel_skips_the_step_together_and_keeps_the_ranks_data_in_step_under_accumulation(workspace):
    """Data parallel (the forward exchanges nothing): rank 1's out-of-memory error at step 2's first micro-step
    (``train.grad_accum = 2``) skips the step on both ranks, and both pass the step's two batches, so the ranks'
    data positions stay equal (before: rank 1 had drawn one batch fewer for good)."""
    from wantrain.core.checkpoint import read_checkpoint

    done = torchrun(workspace, "dp_accum", *FSDP, "--max-steps", "3", "--set", "faults.oom_at_steps=[2]",
                    "--set", "train.grad_accum=2")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(workspace / "dp_accum")
    tree = read_checkpoint(run_dir / "checkpoints" / "step_000002").tree
    positions = [(r["data"]["epoch"], r["data"]["index"]) for r in tree["ranks"]]
    assert positions[0] == positions[1] == (0, 4), positions  # 2 steps x 2 micro-steps, the skipped one passed
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["skip_reason"] for r in events if r["_type"] == "OptimizerStepped"}
    assert steps == {1: None, 2: "out of memory", 3: None}  # rank 0's log: skipped with rank 1


def test_a_peer_killed_without_a_word_ends_the_other_rank_and_the_run_resumes(workspace):
    """Rank 1 is SIGKILLed after step 3 under fsdp: rank 0, waiting in step 4's all-gather, ends within seconds
    (its collective fails: the peer's end, not a traceback of its own) and the run resumes from step 2."""
    started = time.monotonic()
    killed = torchrun(workspace, "fsdp_killed", *FSDP, *SHARDED,
                      env={"WANTRAIN_PROBE_KILL_AT": "3", "WANTRAIN_PROBE_STOP_RANK": "1"})
    took = time.monotonic() - started
    assert killed.returncode != 0 and took < ENDS_WITHIN_S + 30, killed.stderr[-3000:]
    assert "]: Traceback" not in killed.stderr, killed.stderr[-3000:]
    assert "failed: its collective lost a peer rank that ended without a word" in killed.stderr, killed.stderr[-8000:]
    assert "resume from '" in killed.stderr and "step_000002' (step 2) with --resume auto" in killed.stderr
    run_dir = only_run_dir(workspace / "fsdp_killed")
    resumed = torchrun(workspace, "fsdp_killed", *FSDP, *SHARDED, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_000004").is_dir()
