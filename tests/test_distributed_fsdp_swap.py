"""Block swap under sharded weights (docs/distributed.md, "Block swap under fsdp"): two gloo ranks train the tiny
T2V model's high-noise expert under ``model.parallel = "fsdp"`` with ``model.blocks_to_swap = 1``: the shards of its
last block (run order, as one-GPU block swap counts) live on the host through FSDP2's CPU offload, their LoRA
stepped there. On the CPU the arithmetic is the run without swap's, so the files must be byte-equal to it; rank 1
stops the swapped run after step 2 and the resumed run must give the uninterrupted one's checkpoint and LoRA bit for
bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import test_distributed
from safetensors.torch import load_file
from test_distributed import FSDP, SHARDED, loras, only_run_dir, probe, torchrun

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

SWAP = ["--set", "model.gradient_checkpointing=true"]  # block swap needs it (its rule): both runs recompute


@pytest.fixture(scope="module")
def runs(workspace: Path) -> dict[str, Path]:
    """fsdp without swap (4 steps), and fsdp with one block swapped stopped by rank 1 after step 2 (that run
    directory copied as it was) and resumed to step 4."""
    plain = torchrun(workspace, "plain", *FSDP, *SHARDED, *SWAP)
    assert plain.returncode == 0, plain.stderr[-3000:]
    swapped = [*FSDP, *SHARDED, *SWAP, "--set", "model.blocks_to_swap=1"]
    stopped = torchrun(workspace, "swap", *swapped,
                       env={"WANTRAIN_PROBE_STOP_AT": "2", "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    run_dir = only_run_dir(workspace / "swap")
    copy = workspace / "swap_stopped" / run_dir.name
    shutil.copytree(run_dir, copy)
    resumed = torchrun(workspace, "swap", *swapped, "--resume", "auto",
                       env={"WANTRAIN_PROBE_DIR": str(workspace / "swap_resumed_probe")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"plain": only_run_dir(workspace / "plain"), "swap": run_dir, "stopped": copy}


def tensors(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "tensors.safetensors"))


def test_fsdp_with_block_swap_holds_the_last_block_on_the_host_and_writes_the_files_of_fsdp_without(workspace,
                                                                                                     runs):
    for rank in (0, 1):  # the tiny model's 2 blocks: the last one's shards on the host, the first one's not
        assert probe(workspace, "swap_resumed", rank)[0]["on_host"] == [[1]]
        assert probe(workspace, "plain", rank)[0]["on_host"] == [[]]
    name = "quickstart_high_noise.safetensors"
    assert (runs["swap"] / name).read_bytes() == (runs["plain"] / name).read_bytes()  # the exported LoRA, byte-equal
    final = loras(runs["swap"])[name]
    assert any(".lora_B." in k and final[k].abs().max() > 0 for k in final)  # it trained (B starts at zero)
    for step in (2, 4):
        mine, theirs = tensors(runs["swap"], step), tensors(runs["plain"], step)
        shared = [k for k in theirs if not k.startswith("ranks")]  # the rest: each rank's streams and timings
        assert any("exp_avg" in k for k in shared) and any("blocks.1." in k for k in shared)  # the host block's too
        assert sorted(shared) == sorted(k for k in mine if not k.startswith("ranks"))
        for key in shared:
            assert mine[key].equal(theirs[key]), (step, key)


def test_fsdp_with_block_swap_stopped_on_rank_1_resumes_bitwise(workspace, runs):
    record, _ = probe(workspace, "swap", 0)
    assert record["status"] == "stopped" and record["steps"][-1][0] == 2
    stopped, plain = tensors(runs["stopped"], 2), tensors(runs["plain"], 2)
    assert all(stopped[k].equal(plain[k]) for k in plain if not k.startswith("ranks"))
    assert not (runs["stopped"] / "checkpoints" / "step_000004").exists()
    resumed = probe(workspace, "swap_resumed", 0)[0]
    assert [s[0] for s in resumed["steps"]] == [3, 4] and resumed["status"] == "completed"
