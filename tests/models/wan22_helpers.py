"""Helpers of the model tests: build a tiny adapter, a raw batch, and a few core-like training steps."""

from __future__ import annotations

import torch

from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

CPU = torch.device("cpu")


def make_adapter(variant: str = "tiny-t2v", *, rank: int = 4, alpha: float | None = None, lr: float = 1e-3,
                 seed: int = 0, lora: dict | None = None, **model):
    return build_adapter(
        ModelConfig(variant=variant, **model), LoraConfig(rank=rank, alpha=alpha, **(lora or {})),
        seed=seed, device=CPU, base_lr=lr,
    )


def raw_batch(batch_size: int = 1, frames: int = 9, size: int = 32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(batch_size, 3, frames, size, size, generator=g) * 2 - 1
    captions = ["a red ball bouncing on the grass", "a dog running on the beach", "city street at night"]
    return {"pixels": pixels, "captions": captions[:batch_size]}


def train_steps(adapter, batch, steps: int, lr: float | None = None) -> torch.optim.Optimizer:
    """A minimal stand-in for the core loop: activate the step's expert, loss, backward, AdamW step."""
    groups = adapter.param_groups()
    if lr is not None:
        for group in groups:
            group["lr"] = lr
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        adapter.loss(batch, expert, generator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer
