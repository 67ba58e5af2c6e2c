"""The adapter layers' forwards without full-size temporaries: LoKr, LoHa and DoRA as peft builds them (the same
parameters, key names and results), computed so that no ``[out, in]`` matrix is kept for backward.

What peft does and what replaces it (``install``, called on a transformer once its adapter is added; docs/models.md,
"Adapter types"; bench/trace_memory.py and bench/bench_adapter_types.py measure both):

* LoKr: peft builds ``s * kron(w1, w2)`` (float32 ``[out, in]``) in every Linear on every forward and runs the input
  through it at full size; autograd keeps the matrix and a float32 copy of the input for backward. Here the
  Kronecker identity: with the input seen as ``X [tokens, a_in, b_in]``, ``(w1 ⊗ w2) x = w1 X w2^T`` (two thin
  contractions, a few per cent of the Linear's FLOPs); :class:`KroneckerDelta` keeps only the input in its own
  dtype and the factors, and recomputes the contractions in backward.
* LoHa: the delta ``s * (w1_a w1_b) ⊙ (w2_a w2_b)`` has rank up to r^2 (its product form, through autograd, would
  keep ``[tokens, r^2]`` float32 per Linear: more than the matrix above ~5000 tokens). So the matrix is still
  built, but only for the moment it is used: :class:`HadamardDelta` keeps the input in its own
  dtype and the four factors, and rebuilds the matrix in backward (one more build of it per step: 2r/tokens of the
  Linear's FLOPs). At most three float32 ``[out, in]`` temporaries live, in one Linear's backward at a time.
* DoRA: peft gets the LoRA's delta weight by running an identity ``eye(in)`` through the LoRA (a float32
  ``[in, in]``: 764 MB for the FFN's down projection at A14B), adds it to a float32 copy of the base weight for the
  row norms, and keeps the LoRA's float32 output and the base output for the magnitude's gradient. Here the row
  norms come from ``B @ A`` over chunks of rows, without autograd (peft detaches them too), and
  :class:`DoraOutput` keeps the base output (its own dtype) and the LoRA's rank-r activation instead, recomputing
  the LoRA's output in backward (rank-r thin).

Every forward is an ``autograd.Function`` or plain tensor code: ``torch.compile`` traces it without a graph break
(tests/models/test_wan22_compile.py). Dropout paths peft has that wantrain never builds (LoKr/LoHa rank dropout,
conv layers) keep peft's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from wantrain.models.wan22.adapter_types import ADAPTER_NAME, base_rows

NORM_ROWS = 1024  # DoRA's row norms: rows of the float32 weight built at a time (at A14B: 1024 x 13824 x 4 = 57 MB)


def _flat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


class KroneckerDelta(torch.autograd.Function):
    """``(w1 ⊗ w2) x`` in float32 without the Kronecker matrix: ``x [..., a_in * b_in]``, ``w1 [a_out, a_in]``
    (the scale folded in), ``w2 [b_out, b_in]``; returns ``[..., a_out * b_out]`` in the factors' dtype. Keeps
    ``x`` (its own dtype) and the factors for backward."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        ctx.save_for_backward(x, w1, w2)
        X = _flat(x, w1.dtype).view(-1, w1.shape[1], w2.shape[1])
        (a_out, a_in), (b_out, b_in) = w1.shape, w2.shape
        # the cheaper order of the two contractions (per token: w1 first a_out a_in b_in + a_out b_in b_out)
        y = (w1 @ X) @ w2.T if a_out * b_in * (a_in + b_out) <= a_in * b_out * (b_in + a_out) else w1 @ (X @ w2.T)
        return y.reshape(*x.shape[:-1], a_out * b_out)

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2 = ctx.saved_tensors
        (a_out, a_in), (b_out, b_in) = w1.shape, w2.shape
        G = grad.reshape(-1, a_out, b_out).to(w1.dtype)
        H = w1.T @ G  # [n, a_in, b_out]: the input's gradient before w2, and w2's gradient's left factor
        grad_x = (H @ w2).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        X = _flat(x, w1.dtype).view(-1, a_in, b_in)  # after grad_x: the float32 copies live one at a time
        grad_w2 = torch.einsum("njk,njl->kl", H, X)  # sum over tokens of (w1^T G_n)^T X_n
        del H
        grad_w1 = torch.einsum("nik,njk->ij", G, X @ w2.T)  # sum over tokens of G_n (X_n w2^T)^T
        return grad_x, grad_w1, grad_w2


class HadamardDelta(torch.autograd.Function):
    """``((w1_a w1_b) ⊙ (w2_a w2_b)) x`` in float32 (the scale folded into ``w1_a``), the ``[out, in]`` matrix built
    for the forward's matmul and rebuilt in backward, never kept. Keeps ``x`` (its own dtype) and the factors."""

    @staticmethod
    def forward(ctx, x, w1a, w1b, w2a, w2b):
        ctx.save_for_backward(x, w1a, w1b, w2a, w2b)
        return F.linear(x.to(w1a.dtype), (w1a @ w1b) * (w2a @ w2b))

    @staticmethod
    def backward(ctx, grad):
        x, w1a, w1b, w2a, w2b = ctx.saved_tensors
        G = grad.reshape(-1, grad.shape[-1]).to(w1a.dtype)
        grad_x = None
        right = w2a @ w2b
        if ctx.needs_input_grad[0]:
            grad_x = (G @ (w1a @ w1b).mul_(right)).reshape(x.shape).to(x.dtype)
        grad_delta = G.T @ _flat(x, w1a.dtype)  # [out, in]
        part = grad_delta * right
        del right
        grad_w1a, grad_w1b = part @ w1b.T, w1a.T @ part
        del part
        part = grad_delta.mul_(w1a @ w1b)
        return grad_x, grad_w1a, grad_w1b, part @ w2b.T, w2a.T @ part


class DoraOutput(torch.autograd.Function):
    """DoRA's addition to the base output: ``(m - 1) * base + m * (ax @ b^T)`` with ``m [out]`` the magnitude over
    the row norms, ``ax [..., r]`` the LoRA's down projection, ``b [out, r]`` its up projection (scale folded in).
    Keeps ``base`` (its own dtype), ``ax``, ``b`` and ``m``; the LoRA's output is recomputed in backward."""

    @staticmethod
    def forward(ctx, base, ax, b, m):
        ctx.save_for_backward(base, ax, b, m)
        return (m - 1) * base + m * (ax @ b.T)

    @staticmethod
    def backward(ctx, grad):
        base, ax, b, m = ctx.saved_tensors
        grad = grad.to(m.dtype)
        lora = ax @ b.T
        grad_m = (grad * (base + lora)).reshape(-1, m.shape[-1]).sum(0)
        grad_base = (grad * (m - 1)).to(base.dtype)
        scaled = grad * m
        grad_ax = scaled @ b
        grad_b = scaled.reshape(-1, b.shape[0]).T @ ax.reshape(-1, b.shape[1])
        return grad_base, grad_ax, grad_b, grad_m.view(m.shape)


def lokr_delta(layer: nn.Module, adapter: str, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """LoKr's ``_get_delta_activations`` through :class:`KroneckerDelta` (peft's ``get_delta_weight`` factors)."""
    w1 = layer.lokr_w1[adapter] if adapter in layer.lokr_w1 else layer.lokr_w1_a[adapter] @ layer.lokr_w1_b[adapter]
    w2 = layer.lokr_w2[adapter] if adapter in layer.lokr_w2 else layer.lokr_w2_a[adapter] @ layer.lokr_w2_b[adapter]
    # the scale: a float, or a 0-dim float32 tensor under compile (compile.tensor_scaling)
    return KroneckerDelta.apply(x, w1 * layer.scaling[adapter], w2)


def loha_delta(layer: nn.Module, adapter: str, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """LoHa's ``_get_delta_activations`` through :class:`HadamardDelta`."""
    return HadamardDelta.apply(x, layer.hada_w1_a[adapter] * layer.scaling[adapter], layer.hada_w1_b[adapter],
                               layer.hada_w2_a[adapter], layer.hada_w2_b[adapter])


@torch.no_grad()
def dora_row_norms(base: nn.Module, b: torch.Tensor, a: torch.Tensor, scaling) -> torch.Tensor:
    """``||W + s * B A||`` per output row, float32 ``[out]``, built ``NORM_ROWS`` rows at a time (no autograd).
    ``W`` is the ``base`` Linear's weight as its forward computes with it (``adapter_types.base_rows``: an fp8 or
    low-bit base is dequantised ``NORM_ROWS`` rows at a time)."""
    norms = [torch.linalg.norm(base_rows(base, slice(i, i + NORM_ROWS)).to(a.dtype) +
                               scaling * (b[i:i + NORM_ROWS] @ a), dim=1)
             for i in range(0, b.shape[0], NORM_ROWS)]
    return torch.cat(norms)


def dora_forward(dora: nn.Module, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name=None):
    """peft's ``DoraLinearLayer.forward`` (what DoRA adds to the base output) through :func:`dora_row_norms` and
    :class:`DoraOutput`; ``x`` is the input peft cast to the LoRA's dtype."""
    norms = dora_row_norms(base_layer, lora_B.weight, lora_A.weight, scaling).to(x.dtype)
    magnitude = dora.weight / norms
    if base_result is None:  # lora.dropout > 0: the base output of the dropped-out input, as peft computes it
        base_result = F.linear(x, base_rows(base_layer, dtype=x.dtype))
    elif base_layer.bias is not None:
        base_result = base_result - base_layer.bias.to(base_result.dtype)  # layerwise fp8: float8 between forwards
    return DoraOutput.apply(base_result, lora_A(x), lora_B.weight * scaling, magnitude)


@contextlib.contextmanager
def dora_magnitudes_from_row_norms() -> Iterator[None]:
    """While peft creates DoRA layers (``add_adapter``), each takes its magnitude ``||W + s * B A||_row`` from
    :func:`dora_row_norms` instead of peft's ``DoraLinearLayer.update_layer``, which adds the float32 ``B A`` to the
    base weight as it is stored (a float8 weight cannot be multiplied or added on the CPU, a low-bit Linear's weight
    is a stand-in) and builds float32 ``[out, in]`` temporaries. The values are peft's for a bf16 base; the run
    draws them again in float32 (``DoRA.init_fp32``)."""
    from peft.tuners.lora.dora import DoraLinearLayer

    peft_update = DoraLinearLayer.update_layer

    def update_layer(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False) -> None:
        norms = dora_row_norms(base_layer, lora_B.float(), lora_A.float(), scaling)
        self.weight = nn.Parameter(norms.to("cpu") if place_on_cpu else norms, requires_grad=True)

    DoraLinearLayer.update_layer = update_layer
    try:
        yield
    finally:
        DoraLinearLayer.update_layer = peft_update


def _lycoris_plain(layer: nn.Module, *parts: str) -> bool:
    """A peft LyCORIS Linear whose adapter has no rank dropout and none of the conv-only parts."""
    return (isinstance(layer.get_base_layer(), nn.Linear) and not layer.rank_dropout.get(ADAPTER_NAME)
            and not any(ADAPTER_NAME in getattr(layer, p, {}) for p in parts))


def install(transformer: nn.Module) -> int:
    """Give every LoKr, LoHa and DoRA Linear of ``transformer`` (wantrain's adapter) the forward above, as instance
    attributes (peft's classes and their state dicts are untouched); returns how many layers. Idempotent."""
    count = 0
    for module in transformer.modules():
        lokr = ADAPTER_NAME in getattr(module, "lokr_w2", {}) or ADAPTER_NAME in getattr(module, "lokr_w2_a", {})
        if lokr and _lycoris_plain(module, "lokr_t2"):
            module._get_delta_activations = lokr_delta.__get__(module)
        elif ADAPTER_NAME in getattr(module, "hada_w1_a", {}) and _lycoris_plain(module, "hada_t1"):
            module._get_delta_activations = loha_delta.__get__(module)
        elif ADAPTER_NAME in (getattr(module, "lora_magnitude_vector", None) or {}) and \
                isinstance(module.get_base_layer(), nn.Linear) and not getattr(module, "fan_in_fan_out", False):
            dora = module.lora_magnitude_vector[ADAPTER_NAME]
            dora.forward = dora_forward.__get__(dora)
        else:
            continue
        count += 1
    return count
