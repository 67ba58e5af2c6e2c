"""Helpers of the model tests: build a tiny adapter, a raw batch, and a few core-like training steps."""

from __future__ import annotations

import os
import re

import torch
from safetensors.torch import save_file

from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

CPU = torch.device("cpu")


def make_adapter(variant: str = "tiny-t2v", *, rank: int = 4, alpha: float | None = None, lr: float = 1e-3,
                 seed: int = 0, lora: dict | None = None, device: torch.device = CPU, **model):
    return build_adapter(
        ModelConfig(variant=variant, **model), LoraConfig(rank=rank, alpha=alpha, **(lora or {})),
        seed=seed, device=device, base_lr=lr,
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


# diffusers name -> original Wan name, the inverse of diffusers' single-file conversion (facts of the format).
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"), (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."),
    (".to_v.", ".v."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"),
    ("norm2", "norm__tmp"), ("norm3", "norm2"), ("norm__tmp", "norm3"),
]


def to_comfyui_keys(state):
    """A diffusers transformer state dict under ComfyUI's single-file key names."""
    out = {}
    for key, value in state.items():
        new = key
        for ours, theirs in _TO_ORIGINAL:
            new = new.replace(ours, theirs)
        new = re.sub(r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation", new)
        new = "head.modulation" if new == "scale_shift_table" else new
        out["model.diffusion_model." + new] = value.contiguous()
    return out


def single_file_pair(tiny_dir, tmp_path, file_dtype: torch.dtype, **model):
    """(folder-loaded adapter, adapter whose low-noise expert comes from a ComfyUI-keyed file in ``file_dtype``),
    both ``tiny-t2v`` training the low-noise expert on the same weights."""
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    state = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()
    single = tmp_path / f"low_noise_{str(file_dtype)[6:]}.safetensors"
    save_file(to_comfyui_keys({k: v.to(file_dtype) for k, v in state.items()}), str(single))
    partial = tmp_path / "no_transformer_2"
    partial.mkdir()
    for entry in os.listdir(path):
        if entry != "transformer_2":
            os.symlink(path / entry, partial / entry)
    folder = make_adapter("tiny-t2v", path=str(path), experts="low_noise", **model)
    from_file = make_adapter("tiny-t2v", path=str(partial), low_noise_file=str(single), experts="low_noise", **model)
    return folder, from_file
