"""Sequence parallelism with everything a long run shows (docs/distributed.md, "Validation and samples under fsdp
and Ulysses"): two gloo ranks split each clip's tokens (``model.sequence_degree = 2``) and train the tiny model with
``[validation]``, ``[sample]`` and per-block compile (the ``eager`` backend: dynamo's graphs and their breaks at
diffusers' context-parallel hooks, without AOTAutograd, half the time; the fsdp file compiles with ``aot_eager``).
Both ranks of the sequence group evaluate the
same clips; rank 1 repeats each of rank 0's sampling calls of the trained expert with rank 0's inputs
(``core.parallel.mirror``), its half of the tokens. Step 0's LoRA is the fresh one in every layout, so the step-0
validation loss and sample latents must equal one process's (resumes under Ulysses:
tests/test_distributed_failures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import float32_bounds
import numpy as np
import pytest
import test_distributed
from test_distributed import FSDP, only_run_dir, probe, torchrun
from test_distributed_fsdp_evaluation import COMPILED, EVALUATION, latents_pictures, one_process_run, validation_losses

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

ULYSSES = ["--set", "model.sequence_degree=2"]
EVEN = ["--set", "data.resolutions=[32]"]  # every bucket's tokens split evenly over the 2 ranks


@pytest.fixture(scope="module")
def split(workspace: Path) -> Path:
    done = torchrun(workspace, "ulysses_eval", *FSDP, *ULYSSES, *EVEN, *EVALUATION, *COMPILED, "--max-steps", "2",
                    env={"WANTRAIN_PROBE_COMPILE_BACKEND": "eager"})  # dynamo alone: the cheapest
    assert done.returncode == 0, done.stderr[-3000:]
    return only_run_dir(workspace / "ulysses_eval")


def test_a_ulysses_run_with_validation_samples_and_compile_equals_one_process_at_step_0(workspace, split):
    records = [json.loads((workspace / "ulysses_eval_probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in records] == ["completed", "completed"]
    assert all(r["compile"]["graphs"] > 0 for r in records)  # the blocks ran compiled
    assert sorted(validation_losses(split)) == [0, 2]
    assert sorted(p.name for p in (split / "samples").glob("*.mp4")) == ["step_000000_00.mp4", "step_000002_00.mp4"]
    assert probe(workspace, "ulysses_eval", 1)[0]["writes"] == []
    one = one_process_run(workspace, "ulysses_eval_one", *EVEN)
    assert validation_losses(split)[0] == pytest.approx(validation_losses(one)[0], rel=float32_bounds.LOSS)
    # the attention's heads split over the ranks: the same latents up to float32 rounding, which may move a value
    # of the picture across one of its 256 levels
    assert np.abs(latents_pictures(split) - latents_pictures(one)).max() <= 1
