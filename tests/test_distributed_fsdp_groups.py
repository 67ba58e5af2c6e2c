"""FSDP inside expert groups, at library level (``core.parallel.sharding.group_shard_mesh`` and ``load_from_leader``):
four forked gloo ranks split into two groups of two; group 0 (ranks 0, 1) trains the tiny T2V twin's high-noise expert,
group 1 (ranks 2, 3) its low-noise one, each expert sharded over its own group's mesh and loaded from the group's
leader (the other rank builds it on ``meta``). Each group's LoRA must equal a one-process run of its expert with
the same global batch and draws. ``wantrain run`` wires them (tests/test_expert_groups_fsdp_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

EXPERTS = ("high_noise", "low_noise")
STEPS = 2
BATCH = 2  # per group and step: one sample per rank of a group of two
LR = 1e-2
RELATIVE_TOLERANCE = 1e-6
"""Of each LoRA tensor, max |a - b| / max |b|, fp32: the group's two gradients are averaged by the reduce-scatter
instead of in one process's batch (measured: 0.0 for both experts)."""


def sample(expert: str, step: int, index: int) -> tuple[dict, torch.Generator]:
    g = torch.Generator().manual_seed(1000 * step + 10 * EXPERTS.index(expert) + index)
    return {"latents": torch.randn(1, 16, 3, 4, 4, generator=g), "text_embeds": torch.randn(1, 8, 32, generator=g)}, g


def build(expert: str, shard_load: str | None):
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    return build_adapter(ModelConfig(variant="tiny-t2v", experts=expert, gradient_checkpointing=False),
                         LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=LR, shard_load=shard_load)


def train(adapter, expert: str, mine: range) -> None:
    transformer = adapter.transformer_for(expert)
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=0.01)
    for step in range(1, STEPS + 1):
        for index in mine:
            batch, g = sample(expert, step, index)
            (adapter.loss(batch, expert, g) / len(mine)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from wantrain.core.parallel import sharding

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    group, in_group = divmod(rank, 2)
    expert = EXPERTS[group]
    adapter = build(expert, "rank0" if in_group == 0 else "meta")
    transformer = adapter.transformer_for(expert)
    mesh = sharding.group_shard_mesh("cpu", 4, 2)
    sharding.shard_per_block(transformer, transformer.blocks, mesh=mesh, param_dtype=None)
    sharding.load_from_leader(transformer, adapter.host_sources.pop(expert, None), torch.device("cpu"), mesh)
    train(adapter, expert, range(in_group, BATCH, 2))
    lora = {n: p.full_tensor() for n, p in transformer.named_parameters() if p.requires_grad}  # in the group
    if in_group == 0:
        save_file({n: t.contiguous() for n, t in lora.items()}, f"{out}/{expert}.safetensors")
    record = {"mesh": mesh.mesh.tolist(), "local": sharding.local_bytes(transformer),
              "global": sum(p.numel() * p.element_size() for p in transformer.parameters())}
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp_groups")
    build(EXPERTS[0], None)  # diffusers and peft imported once, before the fork, not in every rank
    mp.start_processes(_rank, args=(str(out / "store"), str(out)), nprocs=4, start_method="fork")
    return out


@pytest.mark.parametrize("expert", EXPERTS)
def test_each_groups_sharded_expert_equals_its_one_process_run(four_ranks, expert):
    from safetensors.torch import load_file

    reference = build(expert, None)
    start = {n: p.detach().clone() for n, p in reference.transformer_for(expert).named_parameters() if p.requires_grad}
    train(reference, expert, range(BATCH))
    expected = {n: p.detach() for n, p in reference.transformer_for(expert).named_parameters() if p.requires_grad}
    got = load_file(str(four_ranks / f"{expert}.safetensors"))
    assert sorted(got) == sorted(expected)
    assert any(not expected[k].equal(start[k]) for k in expected if ".lora_B." in k)  # it trained
    worst = max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)
    assert worst <= RELATIVE_TOLERANCE, worst


def test_each_group_shards_its_expert_over_its_own_two_ranks(four_ranks):
    records = [json.loads((four_ranks / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["mesh"] for r in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for a, b in ((0, 1), (2, 3)):  # the two ranks of a group hold its expert between them, about half each
        total = records[a]["global"]
        assert records[a]["local"] + records[b]["local"] == total
        assert abs(records[a]["local"] - total / 2) <= 0.02 * total
