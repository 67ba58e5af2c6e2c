"""Device-memory estimate of a training step, part by part, and the planner behind ``model.vram_budget_gb``.

The weights are counted exactly, tensor by tensor, on a ``meta`` build of the variant's architecture in the dtypes
a run gives them (``_keep_in_fp32_modules`` in fp32; with fp8 the Linears diffusers' layerwise casting stores in
float8_e4m3fn; with fp8_scaled those Linears in float8 plus their per-row float32 scales, ``fp8.py``). The
activations use constants measured by ``bench/trace_memory.py`` (a fake-tensor trace of a real-size step on a CPU;
docs/benchmarks.md has its table and the estimate's error on every row). Parts (bytes):

* ``weights resident``: the frozen base outside the swapped blocks (one expert; the other waits on the host), the
  blocks counted in run order as block swap counts them (``swap.run_order``: a VACE variant's VACE blocks first,
  weighed on the real class);
* ``swap buffers``: ``ring`` of the swapped blocks' frozen tensors (``model.blocks_to_swap`` > 0);
* ``LoRA + optimizer``: the adapter's fp32 weights, their gradients and AdamW's two moments (16 bytes per
  parameter), the parameters of ``lora.type`` counted on a ``meta`` build of one block with peft's layers
  (:func:`adapter_block`; LoHa twice LoRA's, LoKr a few per cent, DoRA LoRA's plus a magnitude per row);
* ``checkpointed inputs``: each block's input hidden states, bf16 (``blocks x tokens x width x 2``), kept for the
  recompute; with ``model.offload_activations`` on the host, and on the device only the few in flight;
* ``one recomputed block``: what one block's recompute saves and its backward needs at once, per token
  ``C_WIDTH x width + C_FFN x ffn_width`` bytes and per text token ``C_TEXT x width`` (fp8: plus the bf16 copies
  of the block's Linears);
* ``adapter vs LoRA`` (LoHa, LoKr, DoRA): what the type's layers hold at the recompute's peak beyond a LoRA's
  (negative: less), with the run's forwards (``adapter_forward.py``; ``ADAPTER_TRANSIENT``);
* ``VACE hints`` (VACE variants): the hint each VACE block hands its main block, held from the VACE blocks' run
  to the main block's, and its gradient in the backward (one hidden state each);
* ``workspace``: the layers outside the blocks, the loss, and a fixed allowance.

Sampling (``[sample]``: diffusers' Wan pipeline around the training expert, no autograd), at the sample size:

* ``weights resident`` and ``swap buffers`` as in training; ``LoRA + moments``: the LoRA weights and AdamW's two
  moments (12 bytes per LoRA parameter; the gradients are freed after each step); ``VAE``: its weights in fp32;
* then the larger of ``denoising step``, the transient of one transformer pass at a time (the pipeline runs the
  conditional and the unconditional pass of classifier-free guidance one after the other, not batched):
  ``SAMPLE_FIXED + tokens x (SAMPLE_C_WIDTH x width + SAMPLE_C_FFN x ffn_width)``, and ``VAE decode``, the
  decoder's transient: ``VAE_DECODE_PER_PIXEL x height x width`` (its causal chunks work on a few frames at a time)
  plus the fp32 video (``VIDEO_BYTES_PER_PIXEL x frames x height x width``). The decode constant is the real VAE's
  (a tiny twin's decoder, far narrower, is overestimated).

What the card needs (``device_gib``, the planner's one figure) adds to the tensors what no trace of them shows:

* ``attention backward``: the float32 buffers of scaled-dot-product attention's backward kernel on CUDA, outside
  autograd's tensors (:func:`attention_backward_bytes`; training only, one attention's backward at a time);
* ``fragmentation margin``: 5 % of the larger peak (training with the attention buffer, or sampling), room for the
  caching allocator's fragmentation (an assumption: no GPU has measured it yet);
* ``CUDA context``: 0.75 GiB for the context and cuBLAS workspaces (an assumption too).

``model.vram_budget_gb`` is the usable memory this sum is held against, not the card's label.
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
# What each adapter type's layers hold in one block's recompute beyond LoRA's (bench/trace_memory.py --lora-type,
# docs/benchmarks.md): (float32 copies of the block's FFN weight [ffn, width], bytes per video token per unit of
# width, and per unit of FFN width; negative: less than LoRA's). The run's forwards (adapter_forward.py) keep each
# adapted Linear's input in its own dtype (bf16) where peft's LoRA keeps a float32 copy per Linear, so LoHa and
# LoKr save per unit of width; their backwards build float32 copies of the FFN's wide input per token (LoKr's
# Kronecker contractions, LoHa's delta gradient); LoHa builds its float32 delta weight in the forward and the
# backward of each Linear (never kept: about 2.9 copies of the FFN's weight at the peak); DoRA keeps the base output
# of every adapted Linear. Least squares over T2V-A14B (4590 to 32760 tokens) and TI2V-5B (3510, 7920) traces of two
# blocks, bf16 base: every row within 0.1 GiB.
ADAPTER_TRANSIENT = {"lora": (0.0, 0.0, 0.0), "loha": (2.86, -32.1, 0.43), "lokr": (0.0, -29.0, 8.95),
                     "dora": (0.0, -8.1, 12.9)}
# ... and per text token per unit of width (bench/measure_block_activations.py, saved_tensors_hooks on one block).
C_TEXT = 17.0
# The lean recompute (``model.recompute = "lean"``, recompute.py): what one block's recompute and the backward of
# its largest part (the self-attention's) hold at once, per token per unit of width; the FFN's wide intermediate
# lives for one token chunk only and adds nothing at the peak (bench/trace_memory.py --recompute lean: A14B at
# 32760 and 75600 tokens, 35.0 and 35.6; docs/benchmarks.md).
LEAN_C_WIDTH = 35.3
# In the lean recompute plain LoRA keeps its inputs in bf16 as the run's LoHa, LoKr and DoRA forwards do
# (recompute.py's ``lean_lora_inputs``), and the FFN runs over token chunks: what each type holds beyond LoRA's
# there, in ADAPTER_TRANSIENT's form. LoHa holds what LoRA does; LoKr's backward and DoRA's kept base outputs add
# per token of the FFN's width. Least squares through zero over T2V-A14B traces of two blocks, bf16, offload, at
# 14040, 32760 and 75600 tokens (bench/trace_memory.py --recompute lean --lora-type all): every row within 3.0 %
# (docs/benchmarks.md). fp8's bf16 copies of the Linears live one part at a time: this fraction of the block's.
LEAN_ADAPTER_TRANSIENT = {"lora": (0.0, 0.0, 0.0), "loha": (0.0, 0.0, 0.0), "lokr": (0.0, 0.0, 3.03),
                          "dora": (0.0, 0.0, 8.97)}
LEAN_FP8_COPIES = 0.2
# ... and the FLOPs it adds: every part's forward runs once more per step, as a fraction of the whole-block
# recompute's step (bench/trace_memory.py --recompute all --flops).
LEAN_EXTRA_FLOPS = 0.26
RECOMPUTE_PATHS = ("block", "lean")  # the planner's order: the whole-block recompute first (fewer FLOPs)
RECOMPUTE_WORDS = {
    "block": "block (each checkpointed block recomputed whole in the backward pass; the step's FLOPs as they are)",
    "lean": f"lean (self-attention, cross-attention and FFN token chunks recomputed each in its own backward; "
            f"+{100 * LEAN_EXTRA_FLOPS:.0f} % FLOPs per step)",
}
# With activation offload, the block inputs still on the device: this many blocks' worth plus a fixed part (the
# block recomputing and the next one's inputs, prefetched while it does: bench/trace_memory.py).
OFFLOAD_BLOCKS = 2.03
OFFLOAD_FIXED = 0.53 * GIB
WORKSPACE_FIXED = 0.10 * GIB
FRAGMENTATION = 1.05  # the card figure's margin: 5 % of the larger peak (attention_backward_bytes included)
CUDA_OVERHEAD = 0.75 * GIB
# Scaled-dot-product attention's backward on CUDA (FlashAttention-2's ``mha_bwd`` in torch's flash backend) allocates
# outside autograd's tensors a float32 dQ accumulator [batch, tokens rounded up to 128, heads, head_dim rounded up
# to 32] and ``softmax_d`` [batch, heads, tokens rounded up to 128]; the memory-efficient backend's dQ accumulator
# is the same float32 size. A CPU trace (bench/trace_memory.py) never sees them.
ATTENTION_TOKENS_ROUND = 128
ATTENTION_HEAD_DIM_ROUND = 32
# What that buffer is for each ``model.attention`` kernel (``attention.py``): flash-attn 2's ``mha_bwd`` is the kernel
# torch's flash backend wraps, and xformers' cutlass backward accumulates dQ in float32 of the same layout (it calls
# flash-attn's when that is installed): one size, three names, so the plan says whose buffer it counts.
ATTENTION_BACKWARD_KERNELS = {
    "sdpa": "float32 dQ accumulator of torch's flash/efficient attention backward",
    "flash": "float32 dQ accumulator of flash-attn 2's backward (mha_bwd)",
    "xformers": "float32 dQ accumulator of xformers' memory-efficient backward",
}
SWAP_RING = 2
LORA_BYTES_PER_PARAM = 16  # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq
LORA_SAMPLING_BYTES_PER_PARAM = 12  # while sampling: no gradient
# the waiting expert's adapter on the host: fp32 weight and AdamW's two moments. No gradient: the loop sets the
# gradients to None after every step (core/loop.py), and an expert switches only between steps.
WAITING_LORA_BYTES_PER_PARAM = 12
WAITING_LORA_PART = "waiting expert's LoRA + AdamW"
# Sampling, measured with ``bench/trace_memory.py --sampling`` (docs/benchmarks.md): one no-grad transformer pass's
# transient per token, per unit of width and of FFN width (fit to A14B and TI2V-5B; the same at 2 and at 40 blocks
# and from 4590 to 75600 tokens) ...
SAMPLE_C_WIDTH = 11.4
SAMPLE_C_FFN = 10.3
SAMPLE_FIXED = 0.013 * GIB
# ... and the VAE decode's transient per pixel of a frame, by VAE family (fp32 VAE), plus the decoded fp32 video.
VAE_DECODE_PER_PIXEL = {"wan2.1": 19460.0, "wan2.2": 21500.0}
VIDEO_BYTES_PER_PIXEL = 12.5


@attrs.frozen
class MemorySettings:
    base_dtype: str  # "fp32", "bf16", "fp8", "fp8_scaled", "int8" or "nf4"
    blocks_to_swap: int = 0
    offload_activations: bool = False
    recompute: str = "block"  # model.recompute: "block" or "lean" (recompute.py)

    def describe(self) -> str:
        parts = [f"{self.base_dtype} base"]
        parts.append(f"{self.blocks_to_swap} blocks swapped" if self.blocks_to_swap else "no block swap")
        parts.append("activations offloaded" if self.offload_activations else "activations on the device")
        parts.append(f"{self.recompute} recompute")
        return ", ".join(parts)

    @property
    def extra_flops(self) -> float:
        """FLOPs per step beyond the whole-block recompute's, as a fraction of them (``LEAN_EXTRA_FLOPS``)."""
        return LEAN_EXTRA_FLOPS if self.recompute == "lean" else 0.0


@attrs.frozen
class SampleSize:
    """What ``[sample]`` generates: the video size and whether classifier-free guidance runs a second pass."""

    width: int
    height: int
    frames: int
    guidance: bool = True

    def describe(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}" + (", guidance" if self.guidance else "")


@attrs.frozen
class AdapterSpec:
    """What the plan needs of ``[lora]``: the adapter type (``lora.type``) and LoKr's factorisation, which set the
    adapter's parameter count and what its layers build on every forward (``ADAPTER_TRANSIENT``)."""

    type: str = "lora"
    lokr_factor: int = -1
    lokr_decompose_both: bool = False

    @classmethod
    def of(cls, lora: Any) -> AdapterSpec:
        """The spec of a ``LoraConfig`` (``[lora]``)."""
        return cls(lora.type, lora.lokr_factor, lora.lokr_decompose_both)

    def describe(self, rank: int) -> str:
        from wantrain.models.wan22.adapter_types import TYPE_TITLES

        return f"{TYPE_TITLES[self.type]}, rank {rank}"


LORA = AdapterSpec()
ADAPTER_PART = "adapter vs LoRA"  # the part ADAPTER_TRANSIENT counts (absent for LoRA; negative: less than LoRA's)


# The sampling parts that are alternatives (the pipeline decodes after the last denoising step): the peak has the
# larger of the two.
SAMPLING_PHASES = ("denoising step", "VAE decode")


@attrs.frozen
class MemoryEstimate:
    settings: MemorySettings
    parts: dict[str, float]  # bytes, in print order
    sampling_parts: dict[str, float]  # empty: no sampling planned ([sample] off)
    link_bytes: float = 0.0  # host<->device bytes per step the settings add (swap copies, offloaded inputs)
    sample: SampleSize | None = None
    attention_backward: float = 0.0  # bytes: attention_backward_bytes, on top of the training step's tensors
    attention_kernel: str = "sdpa"  # model.attention: whose backward buffer attention_backward counts
    adapter: str = ""  # the adapter the estimate counts, in words (type, rank, parameters per expert)

    @property
    def allocated(self) -> float:
        """Bytes the tensors need at the step's peak (what a fake-tensor trace of the step counts)."""
        return sum(self.parts.values())

    @property
    def training_peak(self) -> float:
        """Bytes the training step allocates at its peak on CUDA: the tensors and attention's backward buffer
        (what ``torch.cuda.max_memory_allocated`` reports)."""
        return self.allocated + self.attention_backward

    @property
    def larger_peak(self) -> float:
        return max(self.training_peak, self.sampling_allocated)

    @property
    def reserve(self) -> dict[str, float]:
        """What the card figure adds to the larger peak (bytes), in print order."""
        return {"fragmentation margin": (FRAGMENTATION - 1) * self.larger_peak, "CUDA context": CUDA_OVERHEAD}

    @property
    def sampling_allocated(self) -> float:
        """Bytes the tensors need at sampling's peak (0 without sampling)."""
        common = sum(v for k, v in self.sampling_parts.items() if k not in SAMPLING_PHASES)
        return common + max((self.sampling_parts.get(k, 0.0) for k in SAMPLING_PHASES), default=0.0) \
            if self.sampling_parts else 0.0

    @property
    def training_gib(self) -> float:
        return card_gib(self.training_peak)

    @property
    def sampling_gib(self) -> float:
        return card_gib(self.sampling_allocated) if self.sampling_parts else 0.0

    @property
    def device_gib(self) -> float:
        """What the card must have (GiB): the larger peak (training with attention's backward buffer, sampling)
        plus the fragmentation margin and the CUDA context."""
        return card_gib(self.larger_peak)

    def lines(self) -> list[str]:
        from wantrain.models.wan22.lowbit import error_line

        out = [f"  adapter: {self.adapter}"] if self.adapter else []
        quality = error_line(self.settings.base_dtype)
        out += [quality] if quality else []
        out.append(f"  recompute: {RECOMPUTE_WORDS[self.settings.recompute]}")
        out.append("  training step:")
        out += [f"    {name:<26} {value / GIB:7.2f} GiB" for name, value in self.parts.items()]
        out.append(f"    {'tensors at the peak':<26} {self.allocated / GIB:7.2f} GiB")
        if self.attention_backward:
            out.append(f"    {'attention backward':<26} {self.attention_backward / GIB:7.2f} GiB "
                       f"({ATTENTION_BACKWARD_KERNELS[self.attention_kernel]} on CUDA, beside the tensors)")
        if self.sampling_parts:
            out.append(f"  sampling ([sample] {self.sample.describe()}; no autograd):")
            for name, value in self.sampling_parts.items():
                out.append(f"    {name:<26} {value / GIB:7.2f} GiB" + (" (the peak has the larger of these two)"
                                                                      if name == SAMPLING_PHASES[-1] else ""))
            out.append(f"    {'tensors at the peak':<26} {self.sampling_allocated / GIB:7.2f} GiB")
        margin, context = self.reserve.values()
        out.append(f"  {'fragmentation margin':<28} {margin / GIB:7.2f} GiB ({100 * (FRAGMENTATION - 1):.0f} % of the "
                   "larger peak; assumed)")
        out.append(f"  {'CUDA context':<28} {context / GIB:7.2f} GiB (assumed)")
        out.append(f"  {'card needs':<28} {self.device_gib:7.2f} GiB (the larger peak + the margin + the context)")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"settings": attrs.asdict(self.settings), "parts_gib": {k: v / GIB for k, v in self.parts.items()},
                "sampling_parts_gib": {k: v / GIB for k, v in self.sampling_parts.items()},
                "sample": attrs.asdict(self.sample) if self.sample is not None else None,
                "allocated_gib": self.allocated / GIB, "sampling_allocated_gib": self.sampling_allocated / GIB,
                "attention_backward_gib": self.attention_backward / GIB, "adapter": self.adapter,
                "reserve_gib": {k: v / GIB for k, v in self.reserve.items()}, "device_gib": self.device_gib}


def card_gib(peak_bytes: float) -> float:
    """What a card must have (GiB) for a peak of ``peak_bytes`` allocated (tensors and attention's backward
    buffer): plus the fragmentation margin and the CUDA context."""
    return (FRAGMENTATION * peak_bytes + CUDA_OVERHEAD) / GIB


def attention_backward_bytes(variant: str, *, width: int, height: int, frames: int, batch: int = 1,
                             kernel: str = "sdpa") -> float:
    """Bytes of the float32 buffers one attention's backward allocates on CUDA beside autograd's tensors (see the
    constants above): ``4 x batch x heads x round_up(tokens, 128) x (round_up(head_dim, 32) + 1)``, tokens being
    one video's (the queries of self- and cross-attention alike). T2V-A14B at 832x480x81: 40 heads, 32760 -> 32768
    tokens, head_dim 128: 0.63 GiB. ``kernel``: ``model.attention`` (:data:`ATTENTION_BACKWARD_KERNELS`)."""
    if kernel not in ATTENTION_BACKWARD_KERNELS:
        raise ValueError(f"no attention backward buffer known for kernel {kernel!r}")
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    kwargs = planner_kwargs(spec)
    heads, head_dim = kwargs["num_attention_heads"], kwargs["attention_head_dim"]
    tokens = -(-tokens_of(spec, width, height, frames, 1) // ATTENTION_TOKENS_ROUND) * ATTENTION_TOKENS_ROUND
    dim = -(-head_dim // ATTENTION_HEAD_DIM_ROUND) * ATTENTION_HEAD_DIM_ROUND
    return 4.0 * batch * heads * tokens * (dim + 1)


@functools.lru_cache(maxsize=16)
def stored_meta_build(variant: str, base_dtype: str, layers: int | None = None):
    """A ``meta`` build of one expert stored as the adapter stores it in ``base_dtype`` (``_keep_in_fp32_modules`` in
    fp32; fp8: diffusers' layerwise casting; fp8_scaled: float8 weights, bf16 biases and float32 scales; int8 / nf4:
    bitsandbytes codes, bf16 biases and float32 absmax, ``lowbit.py``)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import (
        cast_keeping_fp32_modules,
        planner_kwargs,
        transformer_class,
        transformer_kwargs,
    )
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    with torch.device("meta"):  # layers: a stack of that many main blocks (a VACE variant's VACE blocks included)
        model = (transformer_class(spec)(**transformer_kwargs(spec)) if layers is None
                 else WanTransformer3DModel(**dict(planner_kwargs(spec), num_layers=layers)))
    cast_keeping_fp32_modules(model, torch.float32 if base_dtype == "fp32" else torch.bfloat16)
    if base_dtype == "fp8":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    elif base_dtype == "fp8_scaled":
        from wantrain.models.wan22.fp8 import to_scaled_fp8

        to_scaled_fp8(model)
    elif base_dtype in ("int8", "nf4"):
        from wantrain.models.wan22.lowbit import to_low_bit

        to_low_bit(model, base_dtype)
    return model


def weight_bytes(variant: str, base_dtype: str, layers: int | None = None) -> tuple[float, tuple[float, ...]]:
    """(bytes outside the blocks, bytes of each block) of one expert's frozen base in ``base_dtype``, counted on a
    ``meta`` build stored as the adapter stores it (:func:`stored_meta_build`); the blocks in the order the forward
    pass runs them, as block swap counts them (``swap.run_order``: a VACE variant's VACE blocks first)."""
    from wantrain.models.wan22.swap import run_order

    model = stored_meta_build(variant, base_dtype, layers)

    def size(module) -> float:
        return float(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))

    blocks = tuple(size(block) for block in run_order(model))
    return size(model) - sum(blocks), blocks


@functools.lru_cache(maxsize=16)
def _linear_bytes_bf16(variant: str, layers: int | None = None) -> float:
    """bf16 bytes of one block's Linear weights (what fp8's layerwise casting materialises while a block runs)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    kwargs["num_layers"] = 1
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
    return float(sum(m.weight.numel() * 2 for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)))


@functools.lru_cache(maxsize=8)
def vae_bytes(variant: str) -> float:
    """fp32 bytes of the variant's VAE (as the sample observer loads it), counted on a ``meta`` build."""
    import torch
    from diffusers import AutoencoderKLWan

    from wantrain.models.wan22.architecture import _TINY_VAE
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    with torch.device("meta"):
        vae = AutoencoderKLWan(**(_TINY_VAE[spec.vae] if spec.tiny else REAL_VAE[spec.vae]))
    params = sum(t.numel() * 4 for t in vae.parameters())
    return float(params + sum(t.numel() * t.element_size() for t in vae.buffers()))


# The real VAE of each family: AutoencoderKLWan's defaults are Wan 2.1's; Wan 2.2's (TI2V-5B) as diffusers'
# conversion script writes it.
REAL_VAE: dict[str, dict[str, Any]] = {
    "wan2.1": {},
    "wan2.2": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                   patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4),
}


def recompute_block_bytes(tokens: float, width: float, ffn: float, text_tokens: float, path: str = "block") -> float:
    """What one checkpointed block's recompute saves and its backward needs at once (bf16 base, fp32 LoRA): per
    video token, per text token (the cross-attention's keys and values, their LoRA inputs); ``path``: the
    recompute (``model.recompute``), whose ``lean`` form has no FFN term (its FFN runs over token chunks)."""
    if path == "lean":
        return tokens * LEAN_C_WIDTH * width + text_tokens * C_TEXT * width
    return tokens * (C_WIDTH * width + C_FFN * ffn) + text_tokens * C_TEXT * width


def adapter_transient_bytes(variant: str, adapter: AdapterSpec, tokens: float, path: str = "block") -> float:
    """What one block's recompute holds beyond LoRA's for ``adapter``'s type, bytes: ``ADAPTER_TRANSIENT``, or
    ``LEAN_ADAPTER_TRANSIENT`` on the lean recompute (``path``)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    d, f = kwargs["num_attention_heads"] * kwargs["attention_head_dim"], kwargs["ffn_dim"]
    table = LEAN_ADAPTER_TRANSIENT if path == "lean" else ADAPTER_TRANSIENT
    weights, per_width, per_ffn = table[adapter.type]
    return 4.0 * weights * d * f + tokens * (per_width * d + per_ffn * f)


def _shapes_and_weights(variant: str, settings: MemorySettings, layers: int | None):
    """(spec, width, FFN width, block bytes, resident bytes, swap-ring bytes) of one expert under ``settings``."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    kwargs = planner_kwargs(spec)
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    rest, blocks = weight_bytes(variant, settings.base_dtype, layers)
    n = len(blocks)
    swap = min(settings.blocks_to_swap, n)
    ring = min(SWAP_RING, swap) * max(blocks[n - swap:], default=0.0)  # the ring holds swapped blocks only
    return spec, d, kwargs["ffn_dim"], blocks, rest + sum(blocks[: n - swap]), ring


def sampling_parts(variant: str, settings: MemorySettings, sample: SampleSize, *, rank: int,
                   layers: int | None = None, adapter: AdapterSpec = LORA) -> dict[str, float]:
    """The parts of sampling one video of ``sample``'s size with one expert on the device (module docstring)."""
    spec, d, f, _, resident, ring = _shapes_and_weights(variant, settings, layers)
    tokens = tokens_of(spec, sample.width, sample.height, sample.frames, 1)
    pixels = sample.width * sample.height
    return {"weights resident": resident, "swap buffers": ring,
            "LoRA + moments": lora_params(variant, rank, layers, adapter) * LORA_SAMPLING_BYTES_PER_PARAM,
            "VAE": vae_bytes(variant),
            "denoising step": SAMPLE_FIXED + tokens * (SAMPLE_C_WIDTH * d + SAMPLE_C_FFN * f),
            "VAE decode": VAE_DECODE_PER_PIXEL[spec.vae] * pixels + VIDEO_BYTES_PER_PIXEL * pixels * sample.frames}


def lora_params(variant: str, rank: int, layers: int | None = None, adapter: AdapterSpec = LORA) -> float:
    """Adapter parameters of one expert at ``rank`` on the 10 Linears of every block, of ``adapter``'s type (LoHa
    has twice LoRA's, LoKr a few per cent of them, DoRA LoRA's plus a magnitude per output row)."""
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    n = layers if layers is not None else spec.num_layers + len(spec.vace_layers)  # VACE blocks: a block's LoRA
    return n * adapter_block(variant, rank, adapter)[0]


@functools.lru_cache(maxsize=64)
def adapter_block(variant: str, rank: int, adapter: AdapterSpec = LORA) -> tuple[float, float]:
    """(adapter parameters of one block, elements of the block's adapted Linear weights), counted on a ``meta``
    build of one block with peft's layers of ``adapter``'s type, as the run adds them (``adapter_types.py``)."""
    import torch
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.adapter_types import ADAPTER_NAME, adapter_type, candidate_modules
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.config import LoraConfig
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = dict(planner_kwargs(VARIANTS[variant]), num_layers=1)
    lora = LoraConfig(type=adapter.type, rank=rank, lokr_factor=adapter.lokr_factor,
                      lokr_decompose_both=adapter.lokr_decompose_both)
    with torch.device("meta"):
        model = WanTransformer3DModel(**kwargs)
        linears = sum(model.get_submodule(name).weight.numel() for name in candidate_modules(1))
        model.add_adapter(adapter_type(adapter.type).peft_config(lora, candidate_modules(1)),
                          adapter_name=ADAPTER_NAME)
    params = sum(p.numel() for name, p in model.named_parameters() if ADAPTER_NAME in name.split("."))
    return float(params), float(linears)


def tokens_of(spec: Any, width: int, height: int, frames: int, batch: int) -> int:
    latent_frames = (frames - 1) // spec.frame_multiple + 1
    return batch * latent_frames * (height // spec.spatial_multiple) * (width // spec.spatial_multiple)


def step_flops(variant: str, *, width: int, height: int, frames: int, batch: int = 1, recompute: str = "block",
               layers: int | None = None) -> float:
    """FLOPs of one training step of one expert, counted from the shapes (docs/benchmarks.md, "Compute per step";
    ``bench/trace_memory.py --flops`` counts the same step): the blocks' Linears (self-attention q/k/v/o and
    cross-attention q/o on the video tokens, cross-attention k/v on the text tokens, the FFN) and attention
    (4 x queries x keys x width per attention), run as forward, the recompute's forward and an activation-only
    backward (the Linears once more, attention twice): 3 x Linears + 4 x attention, and the lean recompute's
    :data:`LEAN_EXTRA_FLOPS` on top. The LoRA's FLOPs and the embeddings and head are left out: the trace counts
    6 % more on two A14B blocks at 832x480x81 (315 TFLOP against 296), so a step time derived from this is short
    and a share of it long (what the waiting expert's reads cost is not understated)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    kwargs = planner_kwargs(spec)
    d, f = kwargs["num_attention_heads"] * kwargs["attention_head_dim"], kwargs["ffn_dim"]
    n = layers if layers is not None else kwargs["num_layers"]
    tokens, text = tokens_of(spec, width, height, frames, batch), batch * spec.text_len
    linears = 2.0 * n * (tokens * (6 * d * d + 2 * d * f) + text * 2 * d * d)
    attention = 4.0 * n * d * (tokens * tokens / batch + tokens * spec.text_len)
    return (3 * linears + 4 * attention) * (1 + (LEAN_EXTRA_FLOPS if recompute == "lean" else 0.0))


def estimate(variant: str, settings: MemorySettings, *, width: int, height: int, frames: int, rank: int,
             batch: int = 1, layers: int | None = None, gradient_checkpointing: bool = True,
             sample: SampleSize | None = None, attention: str = "sdpa", adapter: AdapterSpec = LORA
             ) -> MemoryEstimate:
    """The parts of one training step's peak, for one expert of ``variant``, and with ``sample`` those of
    sampling one video; ``attention``: the kernel whose backward buffer is counted (``model.attention``)."""
    spec, d, f, blocks, resident, ring = _shapes_and_weights(variant, settings, layers)
    n = len(blocks)
    swap = min(settings.blocks_to_swap, n)
    params = lora_params(variant, rank, layers, adapter)
    tokens = tokens_of(spec, width, height, frames, batch)
    hidden = tokens * d * 2.0
    lean = gradient_checkpointing and settings.recompute == "lean"
    per_block = recompute_block_bytes(tokens, d, f, batch * spec.text_len, "lean" if lean else "block")
    if settings.base_dtype in ("fp8", "fp8_scaled", "int8", "nf4"):  # all compute from bf16 copies of the Linears
        per_block += _linear_bytes_bf16(variant, layers) * (LEAN_FP8_COPIES if lean else 1.0)
    if not gradient_checkpointing:
        inputs, per_block = 0.0, per_block * n
    elif settings.offload_activations:
        inputs = min(n * hidden, OFFLOAD_BLOCKS * hidden + OFFLOAD_FIXED)
    else:
        inputs = n * hidden
    text = batch * spec.text_len * d * 2.0 * 4  # projected text embeddings and their copies
    workspace = WORKSPACE_FIXED + text + tokens * 64 * 4 * 4  # latents, prediction, target, loss terms (fp32)
    parts = {"weights resident": resident, "swap buffers": ring, "LoRA + optimizer": params * LORA_BYTES_PER_PARAM,
             "checkpointed inputs": inputs, "one recomputed block": per_block}
    transient = adapter_transient_bytes(variant, adapter, tokens, "lean" if lean else "block")
    if transient:  # without checkpointing every block keeps its own
        parts[ADAPTER_PART] = transient * (1 if gradient_checkpointing else n)
    if spec.vace:  # each VACE block's hint (and, in the backward, its gradient) waits for the main block it feeds
        parts["VACE hints"] = len(spec.vace_layers) * hidden
    parts["workspace"] = workspace
    sampling = sampling_parts(variant, settings, sample, rank=rank, layers=layers, adapter=adapter) \
        if sample is not None else {}
    # A swapped block crosses twice per step (forward, recompute); offloaded inputs go out and come back.
    link = 2.0 * sum(blocks[n - swap:]) + (2.0 * n * hidden if settings.offload_activations else 0.0)
    backward = attention_backward_bytes(variant, width=width, height=height, frames=frames, batch=batch,
                                        kernel=attention)
    return MemoryEstimate(settings, parts, sampling, link, sample, backward, attention,
                          f"{adapter.describe(rank)}: {params / 1e6:.1f} M parameters per expert")


AUTO_DTYPES = ("bf16", "fp8")  # what base_dtype = "auto" tries, in this order ...
AUTO_LOW_BIT = ("int8", "nf4")  # ... then these where bitsandbytes is installed and the blocks checkpointed


def low_bit_available() -> bool:
    """Whether ``base_dtype = "auto"`` may plan int8 / nf4: bitsandbytes is installed (an optional dependency)."""
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def auto_dtypes(low_bit: bool) -> tuple[str, ...]:
    """The storages ``base_dtype = "auto"`` tries, most precise first among the 16-bit and 8-bit floats, then the
    low-bit ones (``low_bit``): bf16, fp8, int8, nf4. int8 (0.7 % output error) is more precise than fp8 (9 %), but
    slower (dequantised in every forward) and an optional library: it is taken only where no fp8 plan fits."""
    return AUTO_DTYPES + (AUTO_LOW_BIT if low_bit else ())


def candidates(base_dtype: str, blocks: int, recompute: str = "auto", low_bit: bool = False
               ) -> list[MemorySettings]:
    """Settings the planner may choose, in its order of preference: by dtype (``base_dtype`` ``auto``:
    :func:`auto_dtypes`), then by recompute path (``recompute`` ``auto``: the whole block before the lean one, which
    costs FLOPs), then cheapest first by bytes over the host link per step (ties: fewer swapped blocks first)."""
    dtypes = auto_dtypes(low_bit) if base_dtype == "auto" else [base_dtype]
    paths = RECOMPUTE_PATHS if recompute == "auto" else (recompute,)
    out = []
    for dtype in dtypes:
        for path in paths:
            for offload in (False, True):
                for swap in range(blocks + 1):
                    out.append(MemorySettings(dtype, swap, offload, path))
    return out


def plan(variant: str, budget_gib: float, *, base_dtype: str, width: int, height: int, frames: int, rank: int,
         batch: int = 1, sample: SampleSize | None = None, attention: str = "sdpa",
         adapter: AdapterSpec = LORA, recompute: str = "auto", low_bit: bool = False
         ) -> tuple[MemoryEstimate | None, MemoryEstimate]:
    """(the chosen estimate or None, the smallest one). The choice: the first dtype of :func:`candidates` that
    fits (training and, with ``sample``, sampling), within it the first recompute path that fits (``recompute``
    ``auto``: the whole block, else the lean one), and within those the fitting setting moving the fewest bytes
    over the host link per step. ``low_bit``: ``base_dtype = "auto"`` may go on to int8 and nf4
    (:func:`auto_dtypes`; the caller knows whether bitsandbytes is there and the blocks are checkpointed)."""
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    n = spec.all_blocks  # what block swap may take: a VACE variant's VACE blocks too
    best: MemoryEstimate | None = None
    smallest: MemoryEstimate | None = None
    chosen = None  # (dtype, recompute path) of the first fit
    for settings in candidates(base_dtype, n, recompute, low_bit):
        if chosen is not None and (settings.base_dtype, settings.recompute) != chosen:
            break
        est = estimate(variant, settings, width=width, height=height, frames=frames, rank=rank, batch=batch,
                       sample=sample, attention=attention, adapter=adapter)
        if smallest is None or est.device_gib < smallest.device_gib:
            smallest = est
        if est.device_gib <= budget_gib:
            chosen = settings.base_dtype, settings.recompute
            if best is None or est.link_bytes < best.link_bytes:
                best = est
    assert smallest is not None
    return best, smallest


# -- host memory ----------------------------------------------------------------------------------------------------
# What the host holds during a run, part by part (``wantrain check``, docs/models.md "Host memory"). Counted exactly
# on ``meta`` builds where the code keeps a tensor; the runtime allowance is an assumption (no GPU host measured).
RUNTIME_ALLOWANCE = 3.0 * GIB  # Python, torch, the CUDA libraries and context on the host side (assumption)
LOAD_WINDOW = 256 * 2**20  # single_file._REOPEN_BYTES: the file's pages mapped on top of the loaded tensors
_UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")
_EXPERT_NAME = {"high_noise": "high-noise expert", "low_noise": "low-noise expert", None: "transformer"}


# Activation offload sends to the host each block's bf16 input, the projected text embeddings (bf16) and the
# float32 hidden states entering the output norm: 42 tensors for A14B's 40 blocks, as bench/trace_memory.py traces.


def available_host_bytes() -> float:
    """RAM a run started now may use: what psutil calls available plus what this process holds already (its
    resident set: Python, torch and the imports, which the runtime allowance counts)."""
    import psutil

    return float(psutil.virtual_memory().available + psutil.Process().memory_info().rss)


def offload_host_tensors(variant: str, *, width: int, height: int, frames: int, batch: int = 1,
                         layers: int | None = None) -> list[int]:
    """Byte sizes of the host buffers activation offload fills in one step (see the comment above)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    kwargs = planner_kwargs(spec)
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    hidden = tokens_of(spec, width, height, frames, batch) * d * 2
    n = layers if layers is not None else kwargs["num_layers"]
    return [hidden] * n + [batch * spec.text_len * d * 2, 2 * hidden]


# bitsandbytes' CPU quantisers (0.50) allocate float32 working copies beyond their result: measured (VmHWM over a
# 13824 x 5120 A14B FFN weight, lowbit.quantise, the chunk divided by its column scales in float32 included) 29.3
# bytes per weight of a chunk for nf4, 8.2 for int8; lowbit.py quantises CPU_CHUNK_WEIGHTS weights at a time. On
# CUDA the working copies are on the card.
_CPU_QUANTISE_BYTES_PER_WEIGHT = {"int8": 8.2, "nf4": 29.3}


def quantise_in_flight(variant: str, base_dtype: str, cuda: bool) -> float:
    """Host bytes beyond the stored expert while an int8 / nf4 expert loads: the largest block Linear's weight in
    bf16 as it is read (``single_file.load_transformer``), and on a CPU run the quantiser's working copies of one
    chunk of it (``lowbit.CPU_CHUNK_WEIGHTS``)."""
    from wantrain.models.wan22.architecture import planner_kwargs
    from wantrain.models.wan22.lowbit import CPU_CHUNK_WEIGHTS
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = planner_kwargs(VARIANTS[variant])
    d = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    weights = d * max(d, kwargs["ffn_dim"])
    working = 0 if cuda else min(weights, CPU_CHUNK_WEIGHTS) * _CPU_QUANTISE_BYTES_PER_WEIGHT[base_dtype]
    return float(2 * weights + working)


def _slab_waste(sizes: list[int], max_slab: int | None = None) -> float:
    """What pinning ``sizes`` bytes takes beyond them: the unused ends of the pinned slabs they are carved from
    (``pinned.slab_layout``, the function the run sizes its slabs with; torch's pinned allocator gives a slab of a
    power of two exactly)."""
    from wantrain.models.wan22.pinned import WEIGHT_SLAB_MAX, slab_bytes

    return float(slab_bytes(sizes, max_slab or WEIGHT_SLAB_MAX) - sum(sizes))


@functools.lru_cache(maxsize=16)
def host_tensor_bytes(variant: str, base_dtype: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(byte sizes of the frozen tensors outside the blocks, per block the byte sizes of its frozen tensors) of one
    expert in ``base_dtype`` storage: what the waiting copies and the swap's host copies hold, tensor by tensor."""
    from wantrain.models.wan22.swap import run_order

    model = stored_meta_build(variant, base_dtype)

    def sizes(module) -> tuple[int, ...]:
        return tuple(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    blocks = tuple(sizes(block) for block in run_order(model))
    inside = {id(t) for block in run_order(model) for t in [*block.parameters(), *block.buffers()]}
    rest = tuple(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if id(t) not in inside)
    return rest, blocks


@functools.lru_cache(maxsize=4)
def encoder_bytes(variant: str, compute_dtype: str) -> tuple[float, float]:
    """(text encoder bytes in ``compute_dtype``, VAE bytes in float32) of ``variant``, on ``meta`` builds: UMT5-XXL
    (the released encoder's sizes) or the tiny twin's, the Wan 2.1 or Wan 2.2 VAE."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from wantrain.models.wan22 import architecture
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    with torch.device("meta"):
        if spec.tiny:
            text = architecture.tiny_text_encoder(spec, 0)
            vae = AutoencoderKLWan(**architecture._TINY_VAE[spec.vae])
        else:
            text = UMT5EncoderModel(UMT5Config(**_UMT5_XXL))
            from wantrain.models.wan22.vae_file import RELEASED_VAE

            vae = AutoencoderKLWan(**RELEASED_VAE[spec.vae])
    per = {"fp32": 4, "bf16": 2, "fp8": 2}[compute_dtype]
    unique = {id(p): p.numel() for p in text.parameters()}  # embed_tokens is tied to shared
    return float(sum(unique.values()) * per), float(sum(p.numel() * 4 for p in vae.parameters()))


LOADING = "while loading"

# The part every phase holds, the first one (the encoders, before the experts load) only this one.
RUNTIME_PART = "runtime (Python, torch, CUDA; assumed)"


@attrs.frozen
class HostEstimate:
    """Host memory of a run: ``parts`` held for the whole run, ``phases`` what each phase adds on top (bytes), in
    the order the run goes through them; the phases in ``before_experts`` come before any expert loads and hold,
    of the parts, the runtime only."""

    parts: dict[str, float]
    phases: dict[str, dict[str, float]]
    pinned: str  # how the copies are pinned (for the lines)
    before_experts: tuple[str, ...] = ()
    ranks_on_host: int = 1  # torchrun ranks sharing this host (each holds ``parts`` and its phases)
    # phases only some of those ranks go through (the others hold ``parts`` alone meanwhile), with how many do:
    # under fsdp the loading ranks (rank 0, each group's leader), while the cache fills rank 0 (the others find it
    # filled and load no encoder: app.assemble)
    few: dict[str, int] = attrs.field(factory=dict)
    switch_read: Any = None  # waiting.SwitchRead: the waiting expert on disk, what each switch reads

    def phase_total(self, phase: str) -> float:
        held = self.parts.get(RUNTIME_PART, 0.0) if phase in self.before_experts else sum(self.parts.values())
        return held + sum(self.phases[phase].values())

    @property
    def peak(self) -> float:
        return max(self.phase_total(p) for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    def machine_total(self, phase: str) -> float:
        """What the ``ranks_on_host`` ranks of this host hold together in ``phase``: the ranks of ``few`` go
        through it, the others hold their ``parts`` alone meanwhile; else every rank the same."""
        some = min(self.few.get(phase, self.ranks_on_host), self.ranks_on_host)
        return some * self.phase_total(phase) + (self.ranks_on_host - some) * sum(self.parts.values())

    @property
    def machine_peak_phase(self) -> str:
        return max(self.phases, key=self.machine_total)

    @property
    def dominant(self) -> str:
        everything = {**self.parts, **{k: v for p in self.phases.values() for k, v in p.items()}}
        return max(everything, key=lambda k: everything[k])

    def lines(self) -> list[str]:
        out = [f"  {name:<44} {value / GIB:7.2f} GiB" for name, value in self.parts.items()]
        for phase, extra in self.phases.items():
            for name, value in extra.items():
                out.append(f"  {name + ' (' + phase + ')':<44} {value / GIB:7.2f} GiB")
        for phase in self.phases:
            out.append(f"  {'total ' + phase:<44} {self.phase_total(phase) / GIB:7.2f} GiB")
        out.append(f"  peak {self.peak / GIB:.2f} GiB ({self.peak_phase}); largest part: {self.dominant}; "
                   f"{self.pinned}")
        sharded = LOADING in self.few
        if sharded:
            out.append(f"  the other ranks while loading: no copy of the expert (built on meta, their shards arrive "
                       f"on the GPU): total {sum(self.parts.values()) / GIB:.2f} GiB each")
        if self.ranks_on_host > 1:
            phase = self.machine_peak_phase
            loading = (f", {self.few[LOADING]} of them loading an expert whole" if sharded
                       else ", each loading its own expert")
            out.append(f"  this machine ({self.ranks_on_host} ranks{loading}): {self.machine_total(LOADING) / GIB:.2f}"
                       f" GiB while loading, {self.machine_total(phase) / GIB:.2f} GiB at its peak ({phase})")
        if self.switch_read is not None:
            out.append(self.switch_read.line())
        out.append(f"  order: {self.order}")
        return out

    @property
    def order(self) -> str:
        """The phases as the run goes through them, in words."""
        if "while the cache fills" not in self.phases:
            return "the experts load (the cache is filled already: no encoder loads), then training"
        if "while the cache fills" in self.before_experts:
            return ("the cache fills with the encoders alone (released after), then the experts load, then "
                    "training")
        return "the experts load, then the cache fills beside them (torchrun: rank 0 first), then training"

    def to_json(self) -> dict[str, Any]:
        return {"parts_gib": {k: v / GIB for k, v in self.parts.items()},
                "phases_gib": {p: {k: v / GIB for k, v in e.items()} for p, e in self.phases.items()},
                "peak_gib": self.peak / GIB, "peak_phase": self.peak_phase, "dominant": self.dominant,
                "before_experts": list(self.before_experts), "order": self.order,
                "ranks_on_host": self.ranks_on_host,
                "waiting_on_disk": self.switch_read.to_json() if self.switch_read is not None else None,
                "machine_peak_gib": max(self.machine_total(p) for p in self.phases) / GIB}


def host_estimate(variant: str, settings: MemorySettings, *, experts: tuple[str | None, ...], rank: int,
                  width: int, height: int, frames: int, batch: int = 1, cuda: bool = True,
                  pin_budget: float | None = None, encoders: bool = True, pin: bool = True,
                  sampling_only: tuple[str, ...] = (), encoders_first: bool = True,
                  adapter: AdapterSpec = LORA, ranks_on_host: int = 1, load_source: float | None = None,
                  loaders_on_host: int = 1, waiting: str = "resident", switch_every: int = 10,
                  read_rate: float | None = None, offloaded_shards: float = 0.0) -> HostEstimate:
    """The host memory of a run of ``experts`` with ``settings`` (what ``models/wan22/placement.py`` and
    ``swap.py`` keep; docs/models.md "Host memory"):

    * each expert's host copy in its storage dtype: with two experts the placement keeps a waiting copy of every
      frozen tensor of both (also while one trains); the swapped blocks' copies are the swap's (one expert or two);
    * pinned slabs (training on CUDA): the swap pins its copies always, the placement when both experts' slabs fit
      in ``pin_budget`` (half the host's memory, ``placement.pin_budget``); pinned copies are carved from
      power-of-two slabs (``pinned.slab_layout``, per expert for the swap and for the placement), whose unused ends
      are counted;
    * ``waiting = "disk"`` (``model.waiting_expert``, two trained experts; ``waiting.py``): no waiting copy; of
      the experts' frozen tensors the host holds the training expert's swapped blocks only (the expert that leaves
      drops its copies before the next is read), and while loading one expert whole until its waiting file is
      written; each switch reads one expert from its file (``HostEstimate.switch_read``, at ``read_rate`` bytes per
      second, ``waiting.DEFAULT_READ_RATE`` unless given, every ``switch_every`` steps);
    * int8 / nf4 storage (``lowbit.py``): each block Linear is quantised as it is read (``single_file.py``), so
      while loading the host holds one Linear in bf16 beyond the stored expert (:func:`quantise_in_flight`);
    * the waiting expert's LoRA and AdamW moments (12 bytes per LoRA parameter; no gradient between steps);
    * ``sampling_only``: the other A14B expert loaded frozen to sample with one trained expert (a host copy like a
      trained one's, no LoRA state);
    * ``pin`` false (``model.pin_host_copies = false``): nothing is pinned, no slabs;
    * with ``settings.offload_activations``, while training: the host buffers of the offloaded activations
      (:func:`offload_host_tensors`), pinned on CUDA (carved from slabs like the others, ``pinned.SlabPool``);
    * one batch read from the cache (latents and text embeddings; the cache is read per step, not held);
    * while loading: one file window and one tensor in flight; under ``model.parallel = "fsdp"`` (``load_source``:
      ``rank_plan.load_peak``'s ``rank0_host``) the loading rank (rank 0, or each expert group's leader) holds the
      expert and its LoRA whole as well, the others nothing (built on ``meta``,
      ``core.parallel.sharding.load_from_rank0``);
      ``ranks_on_host`` ranks sharing the host (``loaders_on_host`` of them loading) add up per machine;
      while the cache fills (``encoders``): UMT5 in the
      compute dtype and the VAE in float32, loaded on the host before they move to the device (a
      ``model.text_encoder_file`` streams into the compute dtype: the same once);
    * ``offloaded_shards``: block swap under ``model.parallel = "fsdp"`` (FSDP2's CPU offload, ``settings`` then
      without swap): this rank's shards of the swapped blocks, their LoRA state and the pinned rounding
      (``rank_offload.offloaded_shards``), held by every rank on the host.

    Phases in the run's order: with ``encoders_first`` (one process, ``app.assemble.encode_before_the_experts``)
    the cache fills first, with the encoders and the runtime alone, and the encoders are released before the
    experts load; without it (torchrun) the cache fills after the experts loaded, beside all of the parts.
    """
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[variant]
    rest, blocks = host_tensor_bytes(variant, settings.base_dtype)
    n = len(blocks)
    swap = min(settings.blocks_to_swap, n)
    swapped = [s for block in blocks[n - swap:] for s in block]
    held_experts = (*experts, *sampling_only)
    on_disk = waiting == "disk" and len(experts) > 1 and not sampling_only
    whole = float(sum(rest) + sum(s for block in blocks for s in block))
    placed = [*rest, *(s for block in blocks[: n - swap] for s in block)] \
        if len(held_experts) > 1 and not on_disk else []
    if pin_budget is None:
        from wantrain.models.wan22.placement import pin_budget as host_pin_budget

        pin_budget = host_pin_budget()
    pin_placed = cuda and pin and bool(placed) and len(held_experts) * (sum(placed) + _slab_waste(placed)) <= pin_budget
    pin_swap = cuda and pin
    parts: dict[str, float] = {}
    rounding = 0.0
    for expert in held_experts[:1] if on_disk else held_experts:
        held = float(sum(placed) + sum(swapped))
        if on_disk and held:
            parts[f"training expert's swap copy ({settings.base_dtype})"] = held
        elif held:
            kind = ", sampling only" if expert in sampling_only else ""
            parts[f"{_EXPERT_NAME[expert]} host copy ({settings.base_dtype}{kind})"] = held
        if pin_swap:
            rounding += _slab_waste(swapped)
        if pin_placed:
            rounding += _slab_waste(placed)
    if rounding:
        parts["pinned slabs' unused ends"] = rounding
    if len(experts) > 1:
        parts[WAITING_LORA_PART] = (len(experts) - 1) * lora_params(variant, rank, adapter=adapter) * \
            WAITING_LORA_BYTES_PER_PARAM
    if offloaded_shards:
        parts["offloaded blocks' shards + LoRA state (FSDP)"] = float(offloaded_shards)
    parts["one batch from the cache"] = _batch_bytes(spec, width, height, frames, batch)
    parts[RUNTIME_PART] = RUNTIME_ALLOWANCE
    largest = max([*rest, *(s for block in blocks for s in block)], default=0)
    phases: dict[str, dict[str, float]] = {}
    filling: dict[str, float] = {}
    if encoders:
        text, vae = encoder_bytes(variant, "fp32" if settings.base_dtype == "fp32" else "bf16")
        filling = {"text encoder (UMT5)": text, "VAE (float32)": vae}
    if filling and encoders_first:
        phases["while the cache fills"] = filling
    phases[LOADING] = {"file window + one tensor": float(LOAD_WINDOW + 2 * largest)}
    if on_disk:  # the expert loading is held whole until its waiting file is written (its swapped blocks: parts)
        phases[LOADING] = {"one expert, until on disk": whole - float(sum(swapped)),
                           **phases[LOADING]}
    if settings.base_dtype in ("int8", "nf4"):  # quantised as the file streams (single_file.py), one Linear at once
        phases[LOADING] = {**phases[LOADING],
                           "one Linear being quantised": quantise_in_flight(variant, settings.base_dtype, cuda)}
    if load_source is not None:
        phases[LOADING] = {"loading rank: expert + LoRA": float(load_source), **phases[LOADING]}
    if filling and not encoders_first:
        phases["while the cache fills"] = filling
    training: dict[str, float] = {}
    if settings.offload_activations:
        offloaded = offload_host_tensors(variant, width=width, height=height, frames=frames, batch=batch)
        training["activation offload buffers"] = float(sum(offloaded))
        if pin_swap:
            from wantrain.models.wan22.pinned import OFFLOAD_SLAB_MAX

            training["offload slabs' unused ends"] = _slab_waste(offloaded, OFFLOAD_SLAB_MAX)
    phases["while training"] = training
    if offloaded_shards and cuda and pin:  # FSDP2 pins the shards it offloads; nothing else is held (one expert)
        pinned = "offloaded shards pinned (FSDP2)" + (
            "" if not placed else "; waiting copies pinned" if pin_placed else "; waiting copies pageable")
    elif not cuda:
        pinned = "nothing pinned (not training on CUDA)"
    elif not pin:
        pinned = "nothing pinned (model.pin_host_copies = false)"
    elif on_disk:
        pinned = "swap copies pinned; no waiting copy (on disk)" if swap else "no waiting copy (on disk)"
    elif pin_placed:
        pinned = "swap and waiting copies pinned"
    elif swap:
        pinned = "swap copies pinned; waiting copies pageable (over half the host's memory)"
    else:
        pinned = "waiting copies pageable (over half the host's memory)" if placed else "nothing pinned"
    if on_disk:
        from wantrain.models.wan22.waiting import DEFAULT_READ_RATE, SwitchRead

        switch = SwitchRead(whole, read_rate or DEFAULT_READ_RATE, switch_every, read_rate is not None,
                            step_flops(variant, width=width, height=height, frames=frames, batch=batch,
                                       recompute=settings.recompute))
    else:
        switch = None
    return HostEstimate(parts, phases, pinned, ("while the cache fills",) if filling and encoders_first else (),
                        ranks_on_host=ranks_on_host, switch_read=switch,
                        few={**({LOADING: loaders_on_host} if load_source is not None else {}),
                             **({"while the cache fills": 1} if filling and not encoders_first else {})})


def _batch_bytes(spec: Any, width: int, height: int, frames: int, batch: int) -> float:
    """Bytes of one cached batch: float32 latents (the VAE's latent grid) and bf16 text embeddings (text_len x
    4096), as the cache entries hold them."""
    latent_frames = (frames - 1) // spec.frame_multiple + 1
    down = 16 if spec.vae == "wan2.2" else 8
    latents = spec.latent_channels * latent_frames * (height // down) * (width // down) * 4
    return float(batch * (latents + spec.text_len * 4096 * 2))
