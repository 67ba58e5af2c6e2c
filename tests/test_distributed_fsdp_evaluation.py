"""Sharded weights with everything a long run shows (docs/distributed.md, "Validation and samples under fsdp and
Ulysses"): two gloo ranks under torchrun train the tiny model with ``model.parallel = "fsdp"``, ``[validation]``,
``[sample]`` and per-block compile (``aot_eager``), are stopped by rank 1 after step 2 and resume to step 4.

Validation: 3 clips over 2 ranks, so rank 1 evaluates one clip and one padding forward (every rank runs as many
sharded forwards). Samples: rank 0 runs the pipeline, rank 1 repeats each of its calls of the sharded expert
(``core.parallel.mirror``); the other expert, sampling only, is rank 0's alone. The reference for both is one
process evaluating the same LoRA: step 0's LoRA is the fresh one (B = 0), the same in every layout, so the
two-rank run's step-0 validation loss and sample latents must equal a one-process run's."""

from __future__ import annotations

import json
from pathlib import Path

import float32_bounds
import numpy as np
import pytest
import test_distributed
from PIL import Image
from test_distributed import FSDP, SHARDED, only_run_dir, probe, torchrun

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

EVALUATION = ["--set", "validation.enabled=true", "--set", "validation.from_training=3", "--set", "validation.every=2",
              "--set", "sample.enabled=true", "--set", "sample.every=2", "--set", "sample.steps=2",
              "--set", "sample.frames=5", "--set", "sample.width=32", "--set", "sample.height=32"]
COMPILED = ["--set", 'model.compile="default"']
ACCURACY = float32_bounds.LOSS
"""Of the step-0 validation loss against one process's: the shards' gathered weights are the same numbers, the
clips' losses are summed over the ranks in another order (tests/float32_bounds.py)."""


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def validation_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["values"]["val/loss"] for r in events(run_dir)
            if r["_type"] == "MetricsLogged" and "val/loss" in r["values"]}


@pytest.fixture(scope="module")
def sharded(workspace: Path) -> Path:
    env = {"WANTRAIN_PROBE_COMPILE_BACKEND": "aot_eager", "WANTRAIN_PROBE_STOP_AT": "2",
           "WANTRAIN_PROBE_STOP_RANK": "1"}
    stopped = torchrun(workspace, "fsdp_eval", *FSDP, *SHARDED, *EVALUATION, *COMPILED, env=env)
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    env["WANTRAIN_PROBE_DIR"] = str(workspace / "fsdp_eval_resumed_probe")
    resumed = torchrun(workspace, "fsdp_eval", *FSDP, *SHARDED, *EVALUATION, *COMPILED, "--resume", "auto", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return only_run_dir(workspace / "fsdp_eval")


def one_process_run(workspace: Path, name: str, *extra: str) -> Path:
    """The same config in one process for one step, uncompiled: its step 0's validation and samples."""
    out = workspace / name
    args = [str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{out}"', "--max-steps", "1",
            *[a for a in FSDP if not a.startswith("--max-steps") and a != "4"], *EVALUATION, *extra]
    assert main(["run", *args]) == 0
    return only_run_dir(out)


def latents_pictures(run_dir: Path) -> np.ndarray:
    return np.asarray(Image.open(run_dir / "samples" / "step_000000_00_latents.png")).astype(np.int16)


@pytest.fixture(scope="module")
def one_process(workspace: Path) -> Path:
    return one_process_run(workspace, "fsdp_eval_one")


def test_an_fsdp_run_with_validation_samples_and_compile_trains_samples_and_resumes(workspace, sharded):
    record0, _ = probe(workspace, "fsdp_eval", 0)
    assert record0["status"] == "stopped" and record0["steps"][-1][0] == 2
    assert record0["compile"]["graphs"] > 0  # the blocks ran compiled, sharded
    resumed = [json.loads((workspace / "fsdp_eval_resumed_probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in resumed] == ["completed", "completed"]
    assert all(r["compile"]["graphs"] > 0 for r in resumed)
    assert [s[0] for s in resumed[0]["steps"]] == [3, 4]  # resumed after step 2
    # validation at step 0, at step 2 (its every) and at the last step; a stop skips none of them but its own
    assert sorted(validation_losses(sharded)) == [0, 2, 4]
    samples = sorted(p.name for p in (sharded / "samples").glob("*.mp4"))
    assert samples == ["step_000000_00.mp4", "step_000002_00.mp4", "step_000004_00.mp4"]
    assert (sharded / "checkpoints" / "step_000004").is_dir()
    assert probe(workspace, "fsdp_eval", 1)[0]["writes"] == []  # rank 1 wrote nothing in the run's folder


def test_step_0_validation_and_samples_equal_one_process(sharded, one_process):
    assert validation_losses(sharded)[0] == pytest.approx(validation_losses(one_process)[0], rel=ACCURACY)
    assert np.array_equal(latents_pictures(sharded), latents_pictures(one_process))
