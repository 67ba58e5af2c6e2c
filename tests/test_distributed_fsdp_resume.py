"""A sharded run (``model.parallel = "fsdp"``) resumed on more ranks than wrote its checkpoint
(docs/distributed.md, "Sharded base weights"): two torchrun ranks train the tiny T2V model's high-noise expert until
rank 1 stops the run after step 2; three ranks resume that checkpoint and train step 3. The checkpoint holds whole
tensors: the three ranks' shards at the start (the probe's ``rank<R>_start.safetensors``) are its LoRA cut in three,
bit for bit; the new rank continues rank 0's random streams (every rank draws the global batch's timesteps and
noise from one stream and keeps its rows), so all three ranks' streams stay equal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import FSDP, SHARDED, only_run_dir, torchrun
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Path]:
    """The 2-rank run stopped after step 2 (its checkpoint copied as it was), then resumed on 3 ranks to step 3."""
    workspace = tmp_path_factory.mktemp("fsdp_resume")
    config = copy_examples(workspace)
    shutil.copy(Path(__file__).parent / "distributed_probe.py", workspace / "distributed_probe.py")
    assert main(["cache", str(config)]) == 0
    stopped = torchrun(workspace, "fsdp", *FSDP, *SHARDED,
                       env={"WANTRAIN_PROBE_STOP_AT": "2", "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    run_dir = only_run_dir(workspace / "fsdp")
    shutil.copytree(run_dir / "checkpoints" / "step_000002", workspace / "written_by_two")
    probe = workspace / "three_probe"
    on = torchrun(workspace, "fsdp", *FSDP, *SHARDED, "--max-steps", "3", "--resume", str(run_dir), nproc=3,
                  env={"WANTRAIN_PROBE_DIR": str(probe)})
    assert on.returncode == 0, on.stderr[-3000:]
    return {"run": run_dir, "two": workspace / "written_by_two", "probe": probe}


def test_three_ranks_resume_a_two_rank_checkpoint_with_its_lora_cut_in_three(resumed):
    two = load_file(str(resumed["two"] / "tensors.safetensors"))
    starts = [load_file(str(resumed["probe"] / f"rank{r}_start.safetensors")) for r in range(3)]
    assert starts[0] and all(sorted(s) == sorted(starts[0]) for s in starts)
    for key in starts[0]:
        whole = torch.cat([s[key] for s in starts])  # each rank's rows, in rank order
        assert whole.equal(two[f"model/weights/{key}"]), key
    assert any(s[k].numel() != starts[0][k].numel() for s in starts for k in s)  # uneven rows: really cut in 3
    notes = [json.loads(x) for x in (resumed["run"] / "log.jsonl").read_text().splitlines()]
    assert any("written by 2 processes" in n.get("note", "") and "rank 2 continues rank 0's random streams"
               in n["note"] for n in notes if n["event"] == "config_warning")


def test_three_ranks_train_on_from_a_two_rank_checkpoint_drawing_from_one_stream(resumed):
    step3 = load_file(str(resumed["run"] / "checkpoints" / "step_000003" / "tensors.safetensors"))
    two = load_file(str(resumed["two"] / "tensors.safetensors"))
    generators = [step3[f"ranks/{r}/generator"] for r in range(3)]
    assert "ranks/3/generator" not in step3
    assert all(g.equal(generators[0]) for g in generators)  # the global batch's draws, one stream on every rank
    lora = [k for k in two if k.startswith("model/weights/") and "lora_B" in k]
    assert lora and all(step3[k].isfinite().all() for k in lora)
    assert any(not step3[k].equal(two[k]) for k in lora)  # step 3 trained
    metrics = [json.loads(x) for x in (resumed["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m][-1] == 3
