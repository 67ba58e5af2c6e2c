"""What one Wan DiT block keeps for its backward pass, per video token per unit of hidden width, by configuration.

Counts the bytes of every tensor autograd saves while one block runs forward (``torch.autograd.graph.
saved_tensors_hooks``; each storage once; the parameters themselves not, as they are resident anyway; the bf16
copies that fp8 layerwise casting makes of the weights yes, since they are new memory kept for backward). The
per-token figure is the slope between two token counts, so what does not grow with the video (the text's keys
and values, fp8 weight copies) is the intercept, reported apart. No GPU needed: the saved tensors of a block are
the same on a CPU (attention saves its output and log-sum-exp there as the CUDA flash kernels do).

The VRAM planner (``wantrain.models.wan22.memory``) took its per-text-token figure (``C_TEXT``) from this script;
``tests/data/test_vram_estimate.py`` runs it on a narrow block with the same proportions and checks that the
planner's "one recomputed block" covers what it measures.

    python bench/measure_block_activations.py            # narrow block (d=1280), every configuration, JSON
    python bench/measure_block_activations.py --real     # the real A14B block too (d=5120; ~1 min, ~3 GB RAM)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

CONFIGURATIONS = {
    # name: (base weights dtype, LoRA dtype, fp8 storage)
    "bf16 base, fp32 LoRA": ("bf16", torch.float32, False),
    "fp8 base, fp32 LoRA": ("fp8", torch.float32, True),
    "fp32 base, fp32 LoRA": ("fp32", torch.float32, False),
    "bf16 base, bf16 LoRA": ("bf16", torch.bfloat16, False),
}
_COMPUTE = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp32": torch.float32}
A14B = dict(width=5120, heads=40, ffn=13824)
NARROW = dict(width=1280, heads=10, ffn=3456)  # A14B's proportions: head dim 128, ffn = 2.7 x width


def build(width: int, heads: int, ffn: int, blocks: int, base_dtype: str, lora_dtype: torch.dtype, fp8: bool,
          checkpointing: bool = False, rank: int = 16):
    """A random ``WanTransformer3DModel`` of A14B's structure at ``width`` with wantrain's LoRA on it."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
    from wantrain.models.wan22.export import ADAPTER_NAME, LORA_TARGET_REGEX
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=blocks, num_attention_heads=heads,
                  attention_head_dim=width // heads, ffn_dim=ffn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**kwargs)
    model = cast_keeping_fp32_modules(model, _COMPUTE[base_dtype]).requires_grad_(False)
    if fp8:
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGET_REGEX), adapter_name=ADAPTER_NAME)
    for name, p in model.named_parameters():
        if f".{ADAPTER_NAME}." in name:
            p.data = p.data.to(lora_dtype)
            p.requires_grad_(True)
    return model.train()


def saved_bytes(model, frames: int, size: int, base_dtype: str, *, block_only: bool, text_tokens: int = 512) -> int:
    """Bytes autograd saves in one forward of ``model`` on latents [1, 16, frames, size, size]: of its first
    block only (``block_only``) or of the whole model. Parameters are not counted; every other storage once."""
    seen: dict[int, int] = {}
    # The parameters' storages now, held so that none is freed and its address reused: fp8 layerwise casting
    # swaps each Linear's weight for a bf16 copy during its forward, and that copy is new memory kept for backward.
    resident = [p.detach() for p in model.parameters()]
    params = {t.untyped_storage().data_ptr() for t in resident}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = []
    if block_only:
        block = model.blocks[0]
        handles.append(block.register_forward_pre_hook(lambda *a: hooks.__enter__()))
        handles.append(block.register_forward_hook(lambda *a: hooks.__exit__(None, None, None)))
    compute = _COMPUTE[base_dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, frames, size, size, generator=g).to(compute)
    text = torch.randn(1, text_tokens, 4096, generator=g).to(compute)
    try:
        with contextlib.nullcontext() if block_only else hooks:
            out = model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                        return_dict=False)[0]
    finally:
        for h in handles:
            h.remove()
    del out
    return sum(seen.values())


def tokens_of(frames: int, size: int) -> int:
    return frames * (size // 2) ** 2  # patch 1x2x2


def per_token_per_width(width: int, heads: int, ffn: int, name: str) -> dict:
    """The block's saved bytes per video token per unit of width (the slope between 1 and 2 latent frames of
    16x16) and the part that does not grow with the video (bytes)."""
    base_dtype, lora_dtype, fp8 = CONFIGURATIONS[name]
    model = build(width, heads, ffn, 1, base_dtype, lora_dtype, fp8)
    small, large = (saved_bytes(model, f, 16, base_dtype, block_only=True) for f in (1, 2))
    t_small, t_large = tokens_of(1, 16), tokens_of(2, 16)
    slope = (large - small) / (t_large - t_small)
    return {"configuration": name, "width": width, "bytes_per_token_per_width": round(slope / width, 2),
            "fixed_bytes": int(small - slope * t_small)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="also the real-width A14B block (d=5120)")
    args = parser.parse_args(argv)
    shapes = [NARROW] + ([A14B] if args.real else [])
    results = []
    for shape in shapes:
        for name in CONFIGURATIONS:
            started = time.perf_counter()
            row = per_token_per_width(shape["width"], shape["heads"], shape["ffn"], name)
            row["seconds"] = round(time.perf_counter() - started, 1)
            results.append(row)
    print(json.dumps({"torch": torch.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
