"""FSDP of a VACE expert (``model.parallel = "fsdp"``, ``app.assemble.shard_experts``, docs/models.md "Control"): two
forked gloo ranks build the tiny VACE twin as ``wantrain run`` does under torchrun (rank 0 loads it whole on the
host, rank 1 builds it on ``meta``; both shard it per block, its VACE blocks each an FSDP unit of their own, and fill
the shards from rank 0), train two AdamW steps on a global batch of two samples with control contexts (one per rank),
and give the LoRA, the VACE blocks' included, of one process training on both samples, within float32's bounds
(tests/float32_bounds.py)."""

from __future__ import annotations

import json
from pathlib import Path

import float32_bounds
import pytest
import torch

pytestmark = pytest.mark.slow

STEPS, BATCH, LR = 2, 2, 1e-2


def sample(step: int, index: int) -> tuple[dict, torch.Generator]:
    """Sample ``index`` of step ``step``'s global batch (cached latents, text embeddings and control context) and the
    generator of its draws."""
    g = torch.Generator().manual_seed(1000 * step + index)
    batch = {"latents": torch.randn(1, 16, 3, 4, 4, generator=g), "text_embeds": torch.randn(1, 8, 32, generator=g),
             "vace_context": torch.randn(1, 96, 3, 4, 4, generator=g)}
    return batch, g


def train(rank: int | None, world: int) -> tuple[object, dict[str, torch.Tensor]]:
    """The adapter as ``wantrain run`` builds it (``rank`` None: one process) trained :data:`STEPS` steps; its whole
    LoRA (under FSDP: rank 0's, {} on the others)."""
    from wantrain.app.assemble import shard_experts
    from wantrain.core.parallel.sharding import full_trainable
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    model = ModelConfig(variant="tiny-vace-t2v", experts="high_noise", parallel="dp" if rank is None else "fsdp")
    adapter = build_adapter(model, LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=LR,
                            shard_load=None if rank is None else "rank0" if rank == 0 else "meta")
    if rank is not None:
        shard_experts(adapter, torch.device("cpu"), world, None)
    transformer = adapter.transformer_for("high_noise")
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    mine = range(rank or 0, BATCH, world)
    for step in range(1, STEPS + 1):
        for index in mine:
            batch, g = sample(step, index)
            (adapter.loss(batch, "high_noise", g) / len(mine)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return adapter, full_trainable(transformer) if rank is not None else {
        n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    adapter, lora = train(rank, world)
    transformer = adapter.transformer_for("high_noise")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in lora.items()}, f"{out}/lora.safetensors")
    units = [isinstance(b, FSDPModule) for b in [*transformer.vace_blocks, *transformer.blocks]]
    Path(f"{out}/rank{rank}.json").write_text(json.dumps({"units": units}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("vace_fsdp")
    from wantrain.app.assemble import shard_experts  # noqa: F401  (imported once, before the fork)
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    # diffusers and peft imported and a twin built once, before the fork, not in every rank; nothing run (a forward
    # here would start torch's thread pool, which a forked child cannot use)
    build_adapter(ModelConfig(variant="tiny-vace-t2v", experts="high_noise"), LoraConfig(rank=4), seed=0,
                  device=torch.device("cpu"), base_lr=LR)
    mp.start_processes(_rank, args=(2, str(out / "store"), str(out)), nprocs=2, start_method="fork")
    return out


def test_a_sharded_vace_expert_trains_the_one_process_lora_with_each_vace_block_a_unit_of_its_own(two_ranks):
    from safetensors.torch import load_file

    for r in (0, 1):
        assert json.loads((two_ranks / f"rank{r}.json").read_text())["units"] == [True] * 4  # 2 VACE + 2 main
    sharded = load_file(str(two_ranks / "lora.safetensors"))
    _, whole = train(None, 1)
    assert sorted(sharded) == sorted(whole)
    vace_b = [k for k in whole if k.startswith("vace_blocks.") and ".lora_B." in k]
    assert len(vace_b) == 23 and all(whole[k].abs().max() > 0 for k in vace_b)  # the VACE LoRA trained
    assert float32_bounds.largest_difference(sharded, whole) <= float32_bounds.adamw_drift(STEPS, LR)
