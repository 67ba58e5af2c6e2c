"""The tiny VACE twin's loss and LoRA gradients for one sample with a control context, in one process or with
Ulysses sequence parallelism over the ranks of a torchrun launch (gloo), for tests/test_distributed_vace_ulysses.py:
``python tests/ulysses_vace_twin.py OUT`` under ``torchrun --nproc_per_node 2`` writes rank 0's loss and the
gradients summed over the ranks to ``OUT/ulysses_vace.safetensors``. :func:`loss_and_gradients` is also the
one-process reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
from wantrain.models.wan22.sequence import enable_ulysses, sum_sequence_gradients


def loss_and_gradients(degree: int) -> dict[str, torch.Tensor]:
    adapter = build_adapter(ModelConfig(variant="tiny-vace-t2v", experts="high_noise", gradient_checkpointing=True),
                            LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=1e-2)
    transformer = adapter.transformer_for("high_noise")
    with torch.no_grad():  # B drawn (it starts at zero): every LoRA, of the VACE blocks too, gets a gradient
        g = torch.Generator().manual_seed(1)
        for name, p in transformer.named_parameters():
            if ".lora_B." in name:
                p.normal_(generator=g)
    if degree > 1:
        enable_ulysses(transformer, degree)
    g = torch.Generator().manual_seed(3)
    batch = {"latents": torch.randn(1, 16, 3, 4, 4, generator=g), "text_embeds": torch.randn(1, 8, 32, generator=g),
             "vace_context": torch.randn(1, 96, 3, 4, 4, generator=g)}  # 12 tokens, 2 heads: both split by 2
    loss = adapter.loss(batch, "high_noise", g)
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
        save_file(result, str(Path(sys.argv[1]) / "ulysses_vace.safetensors"))
    dist.destroy_process_group()
