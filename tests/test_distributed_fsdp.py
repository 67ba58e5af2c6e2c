"""Sharded base weights (``wantrain.core.parallel.sharding``, docs/distributed.md): two gloo ranks under torchrun shard
the tiny TI2V twin per block with FSDP2 and train its LoRA (tests/fsdp_twin.py); one process with the same global batch
and draws is the reference. One launch gives the uninterrupted run, its checkpoint at step 2 and, in the same ranks,
a run resumed from it; the test process resumes the same checkpoint at world size 1."""

from __future__ import annotations

import json
from pathlib import Path

import fsdp_twin
import pytest
import torch
from safetensors.torch import load_file
from test_distributed import torchrun_script, worst_relative

pytestmark = pytest.mark.slow

RELATIVE_TOLERANCE = 1e-6
"""Of each LoRA tensor, max |a - b| / max |b|, fp32: the shards sum in another order than one process (measured:
0.0 on the tiny twin, whose reductions are small enough to come out in the same order)."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    done = torchrun_script("fsdp_twin.py", str(out), cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process() -> dict[str, torch.Tensor]:
    _, lora = fsdp_twin.train(0, 1)
    return lora


def test_fsdp_lora_equals_the_one_process_run_with_the_same_global_batch(two_ranks, one_process):
    start = dict(fsdp_twin.build(1)[1].named_parameters())
    assert all(not one_process[k].equal(start[k].detach()) for k in one_process if ".lora_B." in k)  # it trained
    assert worst_relative(load_file(str(two_ranks / "lora_uninterrupted.safetensors")),
                          one_process) <= RELATIVE_TOLERANCE


def test_each_rank_holds_half_of_the_parameters(two_ranks):
    records = [json.loads((two_ranks / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = records[0]["global_bytes"]
    assert sum(r["local_bytes"] for r in records) == total  # every byte on exactly one rank
    for record in records:
        assert abs(record["local_bytes"] - total / 2) <= 0.02 * total, record  # rows split evenly, up to rounding


def test_a_two_rank_run_resumed_from_its_checkpoint_equals_the_uninterrupted_one_bitwise(two_ranks):
    resumed = load_file(str(two_ranks / "lora_resumed.safetensors"))
    uninterrupted = load_file(str(two_ranks / "lora_uninterrupted.safetensors"))
    assert sorted(resumed) == sorted(uninterrupted)
    for key, value in uninterrupted.items():
        assert resumed[key].equal(value), key


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, one_process):
    checkpoint = two_ranks / "checkpoint"
    assert [p.suffix for p in checkpoint.iterdir()] == [".safetensors"] * 2  # one file per rank, no pickle
    names = set().union(*(load_file(str(p)) for p in checkpoint.glob("*.safetensors")))
    # the LoRA and AdamW's moments and step counters, never a frozen base weight
    assert names and all(".lora_" in n and n.split("/")[0] in ("lora", "optim") for n in names), sorted(names)[:5]
    assert {n.rsplit("/", 1)[-1] for n in names if n.startswith("optim/")} == {"exp_avg", "exp_avg_sq", "step"}
    _, resumed = fsdp_twin.train(0, 1, first=fsdp_twin.SAVE_AT + 1, resume=checkpoint)
    assert worst_relative(resumed, one_process) <= RELATIVE_TOLERANCE
