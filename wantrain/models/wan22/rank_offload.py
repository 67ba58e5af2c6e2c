"""Block swap under sharded weights, planned (``model.blocks_to_swap`` with ``model.parallel = "fsdp"``;
docs/distributed.md, "Block swap under fsdp"): FSDP2's CPU offload of the last N blocks' shards
(``app.assemble.shard_experts``) moves them, their LoRA shards, gradients and AdamW moments from each GPU to its
host. ``rank_plan.rank_estimate`` takes them off the GPU's parts, ``app.memory_plan`` counts them on every rank's
host. Also the counts both share (``rank_plan`` imports them from here): one block's LoRA shards
(:func:`block_lora_shards`) and an expert built on ``meta`` (:func:`meta_expert`)."""

from __future__ import annotations

import functools
import math
from typing import Any

from wantrain.models.wan22.memory import LORA_BYTES_PER_PARAM


def offloaded_shards(variant: str, shard_degree: int, blocks_to_swap: int, rank: int, layers: int | None = None
                     ) -> tuple[float, float, float]:
    """Block swap under FSDP (``model.blocks_to_swap`` with ``model.parallel = "fsdp"``: FSDP2's CPU offload of the
    last N blocks' shards, ``app.assemble.shard_experts``), per GPU: (bytes of those blocks' bf16 frozen shards,
    bytes of their LoRA's shards with its gradient and AdamW's moments (``LORA_BYTES_PER_PARAM``), both on the host
    instead of the GPU; the pinned allocator's power-of-two rounding of the tensors FSDP2 pins on CUDA: each frozen
    and LoRA shard and each LoRA gradient). Counted on a ``meta`` build as ``rank_plan.sharded_weight_bytes`` counts."""
    frozen, rounding, lora_tensors = _block_shards(variant, shard_degree, rank, layers)
    held = frozen[len(frozen) - min(blocks_to_swap, len(frozen)):]
    lora = len(held) * sum(lora_tensors) / 4 * LORA_BYTES_PER_PARAM  # fp32 shards: their elements x 16 bytes
    pinned_lora = sum(2 ** math.ceil(math.log2(t)) - t for t in lora_tensors if t > 0) * 2  # value and gradient
    return (float(sum(held)), float(lora),
            float(sum(rounding[len(rounding) - len(held):]) + len(held) * pinned_lora))


def block_lora_shards(variant: str, rank: int, shard_degree: int) -> tuple[int, ...]:
    """The elements one GPU holds of each LoRA matrix of one block (A [rank, in] and B [out, rank] of its 10
    Linears), each matrix's rows rounded up to a multiple of ``shard_degree`` (FSDP2's padding; 1: whole)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    f = kwargs["ffn_dim"]

    def rows(count: int) -> int:
        return math.ceil(count / shard_degree)

    # (in, out) of the 10 Linears of a block: 8 attention projections d -> d, the FFN d -> f and f -> d
    linears = [(d, d)] * 8 + [(d, f), (f, d)]
    return tuple(n for i, o in linears for n in (rows(rank) * i, rows(o) * rank))


def meta_expert(variant: str, layers: int | None = None) -> Any:
    """One expert of ``variant`` built on ``meta`` in bf16, the ``_keep_in_fp32_modules`` tensors in fp32: what the
    plans per GPU count tensor by tensor."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    if layers is not None:
        kwargs["num_layers"] = layers
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
    cast_keeping_fp32_modules(model, torch.bfloat16)
    return model


@functools.lru_cache(maxsize=32)
def _block_shards(variant: str, shard_degree: int, rank: int, layers: int | None
                  ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...]]:
    """(each block's bf16 frozen shard bytes, each block's power-of-two rounding of them pinned, the byte sizes of
    one block's fp32 LoRA shards), per GPU of ``shard_degree``, on a ``meta`` build."""
    model = meta_expert(variant, layers)
    frozen, rounding = [], []
    for block in model.blocks:
        shards = [math.ceil(p.shape[0] / shard_degree) * (p.numel() // max(p.shape[0], 1)) * p.element_size()
                  if p.dim() else p.element_size() for p in block.parameters()]
        frozen.append(float(sum(shards)))
        rounding.append(float(sum(2 ** math.ceil(math.log2(t)) - t for t in shards if t > 0)))
    lora = tuple(4 * n for n in block_lora_shards(variant, rank, shard_degree))  # fp32
    return tuple(frozen), tuple(rounding), lora
