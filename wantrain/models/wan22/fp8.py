"""Scaled fp8 storage of the frozen base Linears (``model.base_dtype = "fp8_scaled"``, docs/models.md "Memory").

Plain fp8 (``base_dtype = "fp8"``, diffusers' layerwise casting) casts each weight to float8_e4m3fn as it is. E4M3
has 3 mantissa bits and its normal range starts at 2^-6 = 0.0156: a Wan weight of typical size (|w| ~ 0.01-0.05)
falls largely into the subnormals, whose step is a fixed 2^-9, so small rows lose most of their precision.

Scaled fp8 stores, for each of the blocks' Linears (attention q/k/v/out and the feed-forward pair, and a VACE
transformer's VACE blocks' Linears alike: the Linears plain fp8 stores in float8), ``q = round_e4m3(w / s)`` with
**one float32 scale per output row**, ``s = max|w[row]| / 448`` (448 is E4M3's largest finite value), so every row
uses E4M3's whole range. Why per row rather than per block of columns: a row's scale commutes with the matmul
(``x @ (q * s)^T == (x @ q^T) * s``), it is the layout ComfyUI's ``fp8_scaled`` files use (one scale per tensor,
which is a per-row scale repeated), and it costs 4 bytes per output row (about 0.25 MB per A14B block). The bias
stays in the compute dtype (bf16).

The forward dequantises just in time: ``(q.float() * s)`` rounded once to the input's dtype, in chunks of rows so
that the float32 intermediate stays small, then ``F.linear``. The dequantised weight is what autograd keeps for the
backward of the input (the weight needs no gradient): with gradient checkpointing only while one block is
recomputed, without it for every block, which is why fp8 storage needs checkpointing (``ModelConfig``).
``torch._scaled_mm`` is not used: it needs CUDA sm89+, quantises the activations to fp8 too (an error the LoRA's
gradients would see) and has no autograd formula. LoRA (peft) wraps a :class:`ScaledFp8Linear` as any
``nn.Linear`` and adds its update on top of the dequantised base.

Block swap and expert placement move the fp8 ``weight`` (a frozen parameter) and the ``weight_scale`` buffer like
any other frozen tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_NAME = "weight_scale"
_CHUNK_ELEMENTS = 1 << 22  # float32 elements dequantised at once (16 MB)


def quantise_rows(weight: torch.Tensor, via: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn ``weight / scale``, float32 ``scale`` of shape ``[out, 1]``), ``scale = max|row| / 448``
    (1 for an all-zero row). Computed in float32 from ``weight`` as it is (bf16 or fp32), or first rounded to ``via``
    (a loader's training dtype), a few rows at a time: what is allocated besides the result is one chunk's float32
    copies (16 MB), not the whole weight's (a loader quantising each tensor as it is read keeps its peak at the
    model plus one tensor)."""
    out = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty((weight.shape[0], 1), dtype=torch.float32, device=weight.device)
    for piece in row_chunks(weight):
        w = weight[piece].to(via) if via is not None else weight[piece]
        w = w.to(torch.float32)
        absmax = w.abs().amax(dim=1, keepdim=True)
        scale[piece] = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
        out[piece] = (w / scale[piece]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return out, scale


def row_chunks(weight: torch.Tensor) -> list[slice]:
    """Slices of ``weight``'s rows of at most ``_CHUNK_ELEMENTS`` elements (one row at least). A ``meta`` tensor (the
    memory planner's count) is one slice: it holds no memory, and each meta op costs the same whatever its size."""
    if weight.is_meta:
        return [slice(0, weight.shape[0])]
    rows = max(1, _CHUNK_ELEMENTS // max(1, weight.numel() // max(1, weight.shape[0])))
    return [slice(start, start + rows) for start in range(0, weight.shape[0], rows)]


def dequantise(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.float() * scale`` rounded once to ``dtype``, a few rows at a time (the float32 product of a whole
    A14B FFN weight would be 283 MB)."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for piece in row_chunks(weight):
        out[piece] = weight[piece].to(torch.float32).mul_(scale[piece])
    return out


class ScaledFp8Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen ``weight`` is float8_e4m3fn with a float32 ``weight_scale`` buffer
    (``[out_features, 1]``): the real weight is ``weight * weight_scale``. Built by :func:`to_scaled_fp8`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight of its own
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer(SCALE_NAME, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, dequantise(self.weight, self.weight_scale, x.dtype), bias)

    def dequantised_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """Output rows ``rows`` of the weight the forward computes with, in ``dtype`` (DoRA's row norms and export
        read it: ``adapter_types.base_rows``)."""
        return dequantise(self.weight[rows], self.weight_scale[rows], dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 + per-row scale"


def targets(model: nn.Module) -> list[str]:
    """Names of the Linears scaled fp8 stores: every ``nn.Linear`` inside ``model.blocks`` and, in a VACE
    transformer, inside ``model.vace_blocks`` (their ``proj_in`` / ``proj_out`` included): the blocks' Linears
    diffusers' layerwise casting stores in float8 for ``base_dtype = "fp8"``."""
    stacks = ["blocks", *(["vace_blocks"] if hasattr(model, "vace_blocks") else [])]
    return [f"{stack}.{name}" for stack in stacks for name, module in getattr(model, stack).named_modules()
            if isinstance(module, nn.Linear)]


def target_weights(model: nn.Module) -> set[str]:
    """The ``<linear>.weight`` tensor names of :func:`targets` (what a loader may keep in float8)."""
    return {f"{name}.weight" for name in targets(model)}


@torch.no_grad()
def to_scaled_fp8(model: nn.Module, scales: Mapping[str, torch.Tensor] | None = None,
                  compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every Linear of :func:`targets` by a :class:`ScaledFp8Linear`, in place, one at a time (so the extra
    memory is one Linear's). A weight already in float8 whose scale ``scales[<linear>.weight]`` gives (one number
    or one per output row, e.g. from a ComfyUI ``fp8_scaled`` file) is kept with that scale; any other weight is
    quantised by :func:`quantise_rows`. Biases go to ``compute_dtype``. Call before the LoRA is added. Works on
    ``meta`` (the memory planner counts bytes on a meta build)."""
    scales = scales or {}
    for name in targets(model):
        linear = model.get_submodule(name)
        if isinstance(linear, ScaledFp8Linear):
            continue
        given = scales.get(f"{name}.weight")
        if given is not None and linear.weight.dtype == FP8:
            weight = linear.weight.data
            scale = given.to(torch.float32).reshape(-1, 1).expand(weight.shape[0], 1).contiguous()
        else:
            weight, scale = quantise_rows(linear.weight.data)
        bias = linear.bias.data.to(compute_dtype) if linear.bias is not None else None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, ScaledFp8Linear(weight, scale.to(weight.device), bias))
    return model
