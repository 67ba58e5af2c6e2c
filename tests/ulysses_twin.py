"""The tiny TI2V twin's loss and LoRA gradients for one sample, in one process or with Ulysses sequence parallelism
over the ranks of a torchrun launch (gloo), for tests/test_distributed_ulysses.py: ``python tests/ulysses_twin.py
OUT`` under ``torchrun --nproc_per_node 2`` writes rank 0's loss and the gradients summed over the ranks to
``OUT/ulysses.safetensors``. :func:`loss_and_gradients` is also the one-process reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_twin import build, sample
from safetensors.torch import save_file

from wantrain.models.wan22.sequence import enable_ulysses, sum_sequence_gradients


def loss_and_gradients(degree: int) -> dict[str, torch.Tensor]:
    adapter, transformer, _ = build(1)
    if degree > 1:
        enable_ulysses(transformer, degree)
    batch, g = sample(1, 0)  # 12 tokens, 2 heads: both split by 2
    loss = adapter.loss(batch, None, g)
    loss.backward()
    lora = [p for p in transformer.parameters() if p.requires_grad]
    if degree > 1:
        sum_sequence_gradients(lora)
    grads = {n: p.grad.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}
    return {"loss": loss.detach().reshape(1), **grads}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = loss_and_gradients(dist.get_world_size())
    if dist.get_rank() == 0:
        save_file(result, str(Path(sys.argv[1]) / "ulysses.safetensors"))
    dist.destroy_process_group()
