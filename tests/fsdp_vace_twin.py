"""The tiny VACE twin (one expert) trained with its LoRA on samples with control contexts, in one process or sharded
with FSDP2 as ``wantrain run`` shards it under torchrun (gloo; ``app.assemble.shard_experts``: rank 0 loads the
expert whole on the host, the other ranks build it on ``meta``, every block, each VACE block included, an FSDP unit
filled from rank 0), for tests/test_distributed_vace_fsdp.py: ``python tests/fsdp_vace_twin.py OUT`` under
``torchrun --nproc_per_node 2`` writes the whole LoRA (``OUT/lora.safetensors``) and which blocks each rank holds
as FSDP units (``OUT/rank<r>.json``). :func:`train` is also the one-process reference.

Every step trains on a global batch of :data:`BATCH` samples with their own draws: rank ``r`` of ``W`` takes samples
``r, r + W, ...`` and FSDP averages the gradients over the ranks, so both layouts compute the gradient of the global
batch; fp32 throughout, so only the order of the sums differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from wantrain.app.assemble import shard_experts
from wantrain.core.parallel.sharding import full_trainable
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

STEPS, BATCH, LR = 2, 2, 1e-2


def sample(step: int, index: int) -> tuple[dict, torch.Generator]:
    """Sample ``index`` of step ``step``'s global batch (cached latents, text embeddings and control context) and the
    generator of its draws."""
    g = torch.Generator().manual_seed(1000 * step + index)
    batch = {"latents": torch.randn(1, 16, 3, 4, 4, generator=g), "text_embeds": torch.randn(1, 8, 32, generator=g),
             "vace_context": torch.randn(1, 96, 3, 4, 4, generator=g)}
    return batch, g


def train(rank: int | None, world: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The expert as ``wantrain run`` builds it (``rank`` None: one process) trained :data:`STEPS` steps, and its
    whole LoRA (under FSDP rank 0's; {} on the others)."""
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
    if rank is None:
        return transformer, {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}
    return transformer, full_trainable(transformer)


if __name__ == "__main__":
    from torch.distributed.fsdp import FSDPModule

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    transformer, lora = train(rank, dist.get_world_size())
    if rank == 0:
        save_file({k: v.contiguous() for k, v in lora.items()}, str(out / "lora.safetensors"))
    units = [isinstance(b, FSDPModule) for b in [*transformer.vace_blocks, *transformer.blocks]]
    (out / f"rank{rank}.json").write_text(json.dumps({"units": units}))
    dist.destroy_process_group()
