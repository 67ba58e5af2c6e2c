"""Ulysses together with FSDP in ``wantrain run`` (``model.sequence_degree`` with ``model.parallel = "fsdp"``,
docs/distributed.md): two gloo ranks under torchrun split every clip's tokens of the tiny T2V twin's high-noise
expert and shard its blocks over both ranks (the sequence group folded into the shard dimension), and train what one
process trains with the same config. A run stopped by rank 1 and resumed ends as the uninterrupted one."""

from __future__ import annotations

import shutil
from pathlib import Path

import float32_bounds
import pytest
import torch
from safetensors.torch import load_file
from test_distributed import LOSS_TOLERANCE, in_process_run, loras, metrics, only_run_dir, probe, torchrun
from test_distributed import worst_relative as relative
from test_distributed_sequence import GRAD_TOLERANCE, ROOT_TESTS
from test_end_to_end import copy_examples

pytestmark = pytest.mark.slow

SETTINGS = ["train.max_steps=4", "train.log_every=1", "checkpoint.every=2", "observers.progress=false",
            "optimizer.lr=3e-3", 'model.experts="high_noise"', "faults.oom_at_steps=[]", "data.resolutions=[32]",
            'lora.save_dtype="fp32"']
"""4 steps of the high-noise expert (fsdp trains one expert per run), a checkpoint after step 2; 32x32 buckets,
whose tokens per clip are all even (tests/test_distributed_sequence.py)."""
LORA_DRIFT = float32_bounds.adamw_drift(4, 3e-3)
"""The absolute bound on any LoRA element after the 4 high-noise AdamW steps (tests/float32_bounds.py): 4.6e-6."""
BOTH = ["model.sequence_degree=2", 'model.parallel="fsdp"']


def _whole(name: str, workspace: Path, file: str) -> dict[str, torch.Tensor]:
    """Rank 0's and rank 1's shards (rows) of each tensor in ``<name>_probe/rank<R><file>`` joined whole."""
    parts = [load_file(str(workspace / f"{name}_probe" / f"rank{r}{file}")) for r in (0, 1)]
    assert sorted(parts[0]) == sorted(parts[1]) and parts[0]
    return {k: torch.cat([parts[0][k], parts[1][k]]) for k in parts[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The one-process reference, the uninterrupted two-rank run, and one stopped by rank 1 after step 2 and
    resumed with ``--resume auto``."""
    workspace = tmp_path_factory.mktemp("fsdp_sequence")
    copy_examples(workspace)
    shutil.copy(ROOT_TESTS / "distributed_probe.py", workspace / "distributed_probe.py")
    done = torchrun(workspace, "full", settings=[*SETTINGS, *BOTH])
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = torchrun(workspace, "stopped", settings=[*SETTINGS, *BOTH],
                       env={"WANTRAIN_PROBE_STOP_AT": "2", "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    resumed = torchrun(workspace, "stopped", "--resume", "auto", settings=[*SETTINGS, *BOTH],
                       env={"WANTRAIN_PROBE_DIR": str(workspace / "resumed_probe")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    in_process_run(workspace, "single", *[x for item in SETTINGS for x in ("--set", item)])
    return workspace


def test_fsdp_with_a_sequence_degree_of_2_equals_the_one_process_run_and_each_rank_holds_half(runs):
    """One sequence group of 2 ranks (a global batch of 1) sharding the expert over both, against one process of
    batch 1: the same losses within 1e-6, first gradients and LoRA within the sequence-only test's tolerances (the
    gradient sum over the shard mesh divided by the data-parallel size, 1, not by the 2 ranks)."""
    split, one = metrics(only_run_dir(runs / "full")), metrics(only_run_dir(runs / "single"))
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in split] == pytest.approx([r["train/loss"] for r in one], rel=LOSS_TOLERANCE)
    reference_grads = load_file(str(runs / "single_probe" / "rank0_grads.safetensors"))
    assert relative(_whole("full", runs, "_grads.safetensors"), reference_grads) <= GRAD_TOLERANCE
    final, reference = _whole("full", runs, ".safetensors"), probe(runs, "single", 0)[1]
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in final.items())  # it trained
    assert float32_bounds.largest_difference(final, reference) <= LORA_DRIFT
    exported = loras(only_run_dir(runs / "full"))["quickstart_high_noise.safetensors"]
    assert float32_bounds.largest_difference(
        exported, loras(only_run_dir(runs / "single"))["quickstart_high_noise.safetensors"]) <= LORA_DRIFT
    # the blocks' weights (frozen base and LoRA) are split over both ranks: every element on one rank, half each
    held = [probe(runs, "full", r)[0]["block_numel"] for r in (0, 1)]
    assert held[0][1] == held[1][1] and held[0][0] + held[1][0] == held[0][1]
    assert abs(held[0][0] - held[0][1] / 2) <= 0.02 * held[0][1], held
    assert probe(runs, "full", 1)[0]["writes"] == []  # rank 0 alone writes the run directory


def test_fsdp_with_a_sequence_degree_stopped_on_rank_1_resumes_to_the_uninterrupted_run_bitwise(runs):
    record0, _ = probe(runs, "stopped", 0)
    assert record0["status"] == "stopped" and record0["steps"][-1][0] == 2  # rank 0 stopped with rank 1
    resumed = only_run_dir(runs / "stopped")
    full = only_run_dir(runs / "full")
    assert [r["train/loss"] for r in metrics(resumed)] == [r["train/loss"] for r in metrics(full)]
    expected, got = loras(full), loras(resumed)
    assert sorted(got) == sorted(expected) == ["quickstart_high_noise.safetensors"]
    for name, tensors in expected.items():
        for key, value in tensors.items():
            assert value.equal(got[name][key]), (name, key)
    whole, again = _whole("full", runs, ".safetensors"), _whole("resumed", runs, ".safetensors")
    assert sorted(again) == sorted(whole)
    assert all(whole[k].equal(again[k]) for k in whole)  # the fp32 shards too, not only the exported files
