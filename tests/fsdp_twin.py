"""The tiny TI2V twin trained with its LoRA, in one process or sharded with FSDP2 under torchrun (gloo), for
tests/test_distributed_fsdp.py: ``python tests/fsdp_twin.py OUT`` under ``torchrun --nproc_per_node 2`` writes, in
OUT, the LoRA of an uninterrupted run (``lora_uninterrupted.safetensors``), its trainable state at step
:data:`SAVE_AT` (``checkpoint/``, DCP), the LoRA of a second run resumed from there in the same processes
(``lora_resumed.safetensors``) and what each rank held (``rank<r>.json``). :func:`train` is also the one-process
reference, called in the test process.

Every step trains on a global batch of :data:`BATCH` samples with their own draws (timestep, noise): rank ``r`` of
``W`` takes samples ``r, r + W, ...``; the loss of a rank is the mean over its samples and FSDP averages the
gradients over the ranks, so every layout computes the one-process gradient of the global batch. fp32 throughout
(``param_dtype=None``), so only the order of the sums differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from wantrain.core.parallel import sharding
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

STEPS = 4
SAVE_AT = 2
BATCH = 2
LR = 1e-2


def sample(step: int, index: int) -> tuple[dict, torch.Generator]:
    """Sample ``index`` of step ``step``'s global batch (cached latents and text embeddings of the tiny twin) and
    the generator of its draws."""
    g = torch.Generator().manual_seed(1000 * step + index)
    batch = {"latents": torch.randn(1, 48, 3, 4, 4, generator=g), "text_embeds": torch.randn(1, 8, 32, generator=g)}
    return batch, g


def build(world: int) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    """The adapter (same seed on every rank: the same base weights and LoRA start), its transformer sharded per
    block when ``world`` > 1, and an AdamW over the (sharded) trainable parameters."""
    adapter = build_adapter(ModelConfig(variant="tiny-ti2v", gradient_checkpointing=True), LoraConfig(rank=4),
                            seed=0, device=torch.device("cpu"), base_lr=LR)
    transformer = adapter.transformer_for(None)
    if world > 1:
        sharding.shard_per_block(transformer, transformer.blocks, param_dtype=None, reduce_dtype=torch.float32)
    params = [p for p in transformer.parameters() if p.requires_grad]
    return adapter, transformer, torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def train(rank: int, world: int, *, first: int = 1, last: int = STEPS, save: Path | None = None,
          resume: Path | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Steps ``first``..``last``; ``resume``: the checkpoint to start from; ``save``: where to write the trainable
    state after step :data:`SAVE_AT`. Returns the transformer and the whole LoRA (rank 0; {} on the others)."""
    adapter, transformer, optimizer = build(world)
    if resume is not None:
        sharding.initialise_optimizer_state(optimizer)
        sharding.load_trainable(resume, transformer, optimizer)
    for step in range(first, last + 1):
        mine = range(rank, BATCH, world)
        for index in mine:
            batch, g = sample(step, index)
            (adapter.loss(batch, None, g) / len(mine)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if save is not None and step == SAVE_AT:
            sharding.save_trainable(save, transformer, optimizer)
    return transformer, sharding.full_trainable(transformer)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    transformer, lora = train(rank, world, save=out / "checkpoint")
    full = sum(t.numel() * t.element_size() for t in transformer.state_dict().values()
               if not hasattr(t, "to_local"))  # buffers only: every parameter is a DTensor
    record = {"local_bytes": sharding.local_bytes(transformer), "buffer_bytes": full,
              "global_bytes": sum(p.numel() * p.element_size() for p in transformer.parameters())}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        save_file(lora, str(out / "lora_uninterrupted.safetensors"))
    dist.barrier()
    _, resumed = train(rank, world, first=SAVE_AT + 1, resume=out / "checkpoint")
    if rank == 0:
        save_file(resumed, str(out / "lora_resumed.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    main(Path(sys.argv[1]))
