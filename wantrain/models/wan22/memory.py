"""Device-memory estimate of a training step, part by part, and the planner behind ``model.vram_budget_gb``.

The weights are counted exactly, tensor by tensor, on a ``meta`` build of the variant's architecture in the dtypes
a run gives them (``_keep_in_fp32_modules`` in fp32; with fp8 the Linears diffusers' layerwise casting stores in
float8_e4m3fn; with fp8_scaled those Linears in float8 plus their per-row float32 scales, ``fp8.py``). The
activations use constants measured by ``bench/trace_memory.py`` (a fake-tensor trace of a real-size step on a CPU;
docs/benchmarks.md has its table and the estimate's error on every row). Parts (bytes):

* ``weights resident``: the frozen base outside the swapped blocks (one expert; the other waits on the host);
* ``swap buffers``: ``ring`` blocks' frozen tensors (``model.blocks_to_swap`` > 0);
* ``LoRA + optimizer``: fp32 LoRA weights, their gradients and AdamW's two moments (16 bytes per LoRA parameter);
* ``checkpointed inputs``: each block's input hidden states, bf16 (``blocks x tokens x width x 2``), kept for the
  recompute; with ``model.offload_activations`` on the host, and on the device only the few in flight;
* ``one recomputed block``: what one block's recompute saves and its backward needs at once, per token
  ``C_WIDTH x width + C_FFN x ffn_width`` bytes (fp8: plus the bf16 copies of the block's Linears);
* ``workspace``: the layers outside the blocks, the loss, and a fixed allowance.

The planner's total for a budget adds 5 % for the allocator's fragmentation and 0.75 GiB for the CUDA context and
cuBLAS workspaces (assumptions: no GPU has checked them yet).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

GIB = 2**30
# Measured with bench/trace_memory.py (docs/benchmarks.md): bytes per token one recomputed block holds at its
# backward's peak, per unit of hidden width and per unit of FFN width (fit over T2V-A14B and TI2V-5B at two
# resolutions each, bf16 base, fp32 rank-32 LoRA).
C_WIDTH = 75.8
C_FFN = 10.0
# With activation offload, the block inputs still on the device: this many blocks' worth plus a fixed part.
OFFLOAD_BLOCKS = 1.03
OFFLOAD_FIXED = 0.53 * GIB
WORKSPACE_FIXED = 0.10 * GIB
FRAGMENTATION = 1.05
CUDA_OVERHEAD = 0.75 * GIB
SWAP_RING = 2
LORA_BYTES_PER_PARAM = 16  # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq


@attrs.frozen
class MemorySettings:
    base_dtype: str  # "fp32", "bf16", "fp8" or "fp8_scaled"
    blocks_to_swap: int = 0
    offload_activations: bool = False

    def describe(self) -> str:
        parts = [f"{self.base_dtype} base"]
        parts.append(f"{self.blocks_to_swap} blocks swapped" if self.blocks_to_swap else "no block swap")
        parts.append("activations offloaded" if self.offload_activations else "activations on the device")
        return ", ".join(parts)


@attrs.frozen
class MemoryEstimate:
    settings: MemorySettings
    parts: dict[str, float]  # bytes, in print order
    sampling_parts: dict[str, float]
    link_bytes: float = 0.0  # host<->device bytes per step the settings add (swap copies, offloaded inputs)

    @property
    def allocated(self) -> float:
        """Bytes the tensors need at the step's peak (what ``torch.cuda.max_memory_allocated`` reports)."""
        return sum(self.parts.values())

    @property
    def device_gib(self) -> float:
        """What the card must have (GiB): the tensors plus fragmentation and the CUDA context."""
        return (FRAGMENTATION * max(self.allocated, sum(self.sampling_parts.values())) + CUDA_OVERHEAD) / GIB

    def lines(self) -> list[str]:
        out = [f"  {name:<24} {value / GIB:7.2f} GiB" for name, value in self.parts.items()]
        out.append(f"  {'tensors at the peak':<24} {self.allocated / GIB:7.2f} GiB")
        sampling = sum(self.sampling_parts.values())
        if self.sampling_parts:
            out.append(f"  {'sampling (no backward)':<24} {sampling / GIB:7.2f} GiB")
        out.append(f"  {'card needs':<24} {self.device_gib:7.2f} GiB (x{FRAGMENTATION} fragmentation + "
                   f"{CUDA_OVERHEAD / GIB:.2f} GiB CUDA context)")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"settings": attrs.asdict(self.settings), "parts_gib": {k: v / GIB for k, v in self.parts.items()},
                "sampling_parts_gib": {k: v / GIB for k, v in self.sampling_parts.items()},
                "allocated_gib": self.allocated / GIB, "device_gib": self.device_gib}


@functools.lru_cache(maxsize=16)
def weight_bytes(variant: str, base_dtype: str, layers: int | None = None) -> tuple[float, tuple[float, ...]]:
    """(bytes outside the blocks, bytes of each block) of one expert's frozen base in ``base_dtype``, counted on a
    ``meta`` build (fp8: with diffusers' layerwise casting applied, as the adapter applies it)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = transformer_kwargs(VARIANTS[variant])
    if layers is not None:
        kwargs["num_layers"] = layers
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
    dtype = torch.float32 if base_dtype == "fp32" else torch.bfloat16
    cast_keeping_fp32_modules(model, dtype)
    if base_dtype == "fp8":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    elif base_dtype == "fp8_scaled":  # float8 weights, bf16 biases and the float32 scales, as the adapter stores them
        from wantrain.models.wan22.fp8 import to_scaled_fp8

        to_scaled_fp8(model)

    def size(module) -> float:
        return float(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))

    blocks = tuple(size(block) for block in model.blocks)
    return size(model) - sum(blocks), blocks


@functools.lru_cache(maxsize=16)
def _linear_bytes_bf16(variant: str, layers: int | None = None) -> float:
    """bf16 bytes of one block's Linear weights (what fp8's layerwise casting materialises while a block runs)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = transformer_kwargs(VARIANTS[variant])
    kwargs["num_layers"] = 1
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
    return float(sum(m.weight.numel() * 2 for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)))


def lora_params(variant: str, rank: int, layers: int | None = None) -> float:
    """LoRA parameters of one expert at ``rank`` on the 10 Linears of every block."""
    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = transformer_kwargs(VARIANTS[variant])
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    f = kwargs["ffn_dim"]
    n = layers if layers is not None else kwargs["num_layers"]
    # attn1 and attn2: q, k, v, o (d -> d; attn2's k and v read the projected text, also width d); ffn: d->f, f->d
    per_block = 8 * (d + d) + (d + f) + (f + d)
    return float(n * rank * per_block)


def tokens_of(spec: Any, width: int, height: int, frames: int, batch: int) -> int:
    latent_frames = (frames - 1) // spec.frame_multiple + 1
    return batch * latent_frames * (height // spec.spatial_multiple) * (width // spec.spatial_multiple)


def estimate(variant: str, settings: MemorySettings, *, width: int, height: int, frames: int, rank: int,
             batch: int = 1, layers: int | None = None, gradient_checkpointing: bool = True) -> MemoryEstimate:
    """The parts of one training step's peak and of a sampling step, for one expert of ``variant``."""
    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    kwargs = transformer_kwargs(spec)
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    f = kwargs["ffn_dim"]
    rest, blocks = weight_bytes(variant, settings.base_dtype, layers)
    n = len(blocks)
    swap = min(settings.blocks_to_swap, n)
    resident = rest + sum(blocks[: n - swap])
    ring = min(SWAP_RING, swap) * max(blocks, default=0.0)
    lora = lora_params(variant, rank, layers) * LORA_BYTES_PER_PARAM
    tokens = tokens_of(spec, width, height, frames, batch)
    hidden = tokens * d * 2.0
    per_block = tokens * (C_WIDTH * d + C_FFN * f)
    if settings.base_dtype in ("fp8", "fp8_scaled"):  # both compute from bf16 copies of the block's Linears
        per_block += _linear_bytes_bf16(variant, layers)
    if not gradient_checkpointing:
        inputs, per_block = 0.0, per_block * n
    elif settings.offload_activations:
        inputs = min(n * hidden, OFFLOAD_BLOCKS * hidden + OFFLOAD_FIXED)
    else:
        inputs = n * hidden
    text = batch * spec.text_len * d * 2.0 * 4  # projected text embeddings and their copies
    workspace = WORKSPACE_FIXED + text + tokens * 64 * 4 * 4  # latents, prediction, target, loss terms (fp32)
    parts = {"weights resident": resident, "swap buffers": ring, "LoRA + optimizer": lora,
             "checkpointed inputs": inputs, "one recomputed block": per_block, "workspace": workspace}
    sampling = {"weights resident": resident, "swap buffers": ring, "LoRA": lora / 4,
                "one block's forward": tokens * C_WIDTH * d * 0.5, "workspace": workspace}
    # A swapped block crosses twice per step (forward, recompute); offloaded inputs go out and come back.
    link = 2.0 * sum(blocks[n - swap:]) + (2.0 * n * hidden if settings.offload_activations else 0.0)
    return MemoryEstimate(settings, parts, sampling, link)


def candidates(base_dtype: str, blocks: int) -> list[MemorySettings]:
    """Settings the planner may choose, cheapest first by bytes over the host link per step (ties: fewer swapped
    blocks first). ``base_dtype`` ``auto`` lets it try bf16 before fp8."""
    dtypes = ["bf16", "fp8"] if base_dtype == "auto" else [base_dtype]
    out = []
    for dtype in dtypes:
        for offload in (False, True):
            for swap in range(blocks + 1):
                out.append(MemorySettings(dtype, swap, offload))
    return out


def plan(variant: str, budget_gib: float, *, base_dtype: str, width: int, height: int, frames: int, rank: int,
         batch: int = 1) -> tuple[MemoryEstimate | None, MemoryEstimate]:
    """(the chosen estimate or None, the smallest one). The choice: the first dtype of :func:`candidates` that
    fits, and within it the fitting setting moving the fewest bytes over the host link per step."""
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    n = spec.num_layers
    best: MemoryEstimate | None = None
    smallest: MemoryEstimate | None = None
    chosen_dtype = None
    for settings in candidates(base_dtype, n):
        if chosen_dtype is not None and settings.base_dtype != chosen_dtype:
            break
        est = estimate(variant, settings, width=width, height=height, frames=frames, rank=rank, batch=batch)
        if smallest is None or est.device_gib < smallest.device_gib:
            smallest = est
        if est.device_gib <= budget_gib:
            chosen_dtype = settings.base_dtype
            if best is None or est.link_bytes < best.link_bytes:
                best = est
    assert smallest is not None
    return best, smallest
