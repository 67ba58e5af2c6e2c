"""The lean block recompute (``model.recompute = "lean"``): what one checkpointed transformer block holds for its
backward pass, cut to what that backward needs one part at a time.

Gradient checkpointing (``model.gradient_checkpointing``) wraps each ``WanTransformerBlock`` in one non-reentrant
checkpoint: the forward pass keeps the block's input, and the backward pass recomputes the whole block with autograd
on before running its backward. That recompute saves everything the block's backward needs at once: float32
copies of the hidden state around ``norm1``/``norm2``/``norm3``, the modulation and the gated residuals, the
projections, the attention's inputs and output, and the FFN's 13 824-wide intermediate (``C_WIDTH``/``C_FFN`` in
``memory.py``; 16.2 GiB at 832x480x81 on A14B).

The lean block runs diffusers' block arithmetic (the same submodules, the same ops in the same order) in three
parts, each its own non-reentrant checkpoint nested inside the block's:

* self-attention: ``norm1``, the shift/scale modulation, ``attn1`` (RoPE, SDPA), the gated residual;
* cross-attention: ``norm2``, ``attn2``, the residual;
* feed-forward: ``norm3``, the modulation, ``ffn`` and the gated residual, over chunks of
  :data:`FFN_CHUNK_TOKENS` tokens, each chunk its own checkpoint (all of it is per token: chunks are independent).

Inside the parts, two float32 copies go: the norms with their modulation (``norm1``, ``norm2``) are a checkpoint
of their own (only their bf16 output is kept), and each plain LoRA layer keeps its bf16 input for ``lora_A``'s
backward instead of peft's float32 copy of it (:func:`lean_lora_inputs`; q, k and v each made one).

So the block's recompute keeps only the parts' bf16 inputs (three hidden states), and each part is recomputed
again in its own backward, its intermediates alive only while that backward runs; the FFN's wide intermediate
exists for one chunk at a time. The modulation (``scale_shift_table + temb``) is computed inside each part, so no
float32 [6, width] per token (TI2V-5B's per-token modulation) outlives it.

What it costs: every part's forward runs once more (three times per step instead of twice): 26 % more FLOPs per
step at 832x480x81 on A14B (``bench/trace_memory.py --recompute lean --flops``, docs/benchmarks.md). The planner
(``memory.py``) takes it only where the whole-block recompute does not fit.

Gradients: the same arithmetic on the same values, so equal to the whole-block recompute's (bitwise on the tiny
twin on a CPU, fp32 and bf16: ``tests/models/test_recompute.py``); the FFN over token chunks multiplies smaller
matrices, for which a GPU's GEMM may pick kernels that sum in another order (within bf16 rounding). LoRA dropout
draws its masks per chunk (the same distribution, other draws). Traceable (no host syncs, no data-dependent
branches: the chunk count depends on the shape only): ``model.compile`` compiles this forward as it does
diffusers' (``compile.py`` compiles ``type(block).forward``), and block swap's pre-hook (``swap.py``) loads the
block before its recompute, which the parts' recomputes follow inside the block's backward, while the block is
still in the ring.
"""

from __future__ import annotations

import functools

import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformerBlock
from torch import nn
from torch.utils.checkpoint import checkpoint

# Tokens per FFN chunk: the FFN's intermediate [chunk, ffn_width] in bf16 and its LoRA and GELU companions stay
# under ~0.6 GiB at A14B (13 824 wide) while each chunk's matmuls stay large (4096 rows keep a GPU's GEMMs busy).
FFN_CHUNK_TOKENS = 4096


def _modulation(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """diffusers' six modulation vectors (shift, scale, gate of the self-attention, then of the FFN)."""
    if temb.ndim == 4:  # TI2V-5B: one per token, [batch, tokens, 6, width]
        return tuple(c.squeeze(2) for c in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _norm1(block: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    shift_msa, scale_msa = _modulation(block, temb)[:2]
    return (block.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)


def _norm2(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return block.norm2(hidden_states.float()).type_as(hidden_states)


def _self_attention(block: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor,
                    rotary_emb: torch.Tensor) -> torch.Tensor:
    # the float32 norm and modulation: a checkpoint of their own, so that only their bf16 output is kept
    norm_hidden_states = _part(functools.partial(_norm1, block), hidden_states, temb)
    attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
    gate_msa = _modulation(block, temb)[2]
    return (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)


def _cross_attention(block: nn.Module, hidden_states: torch.Tensor,
                     encoder_hidden_states: torch.Tensor) -> torch.Tensor:
    norm_hidden_states = _part(functools.partial(_norm2, block), hidden_states)
    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    return hidden_states + attn_output


def _feed_forward(block: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    c_shift_msa, c_scale_msa, c_gate_msa = _modulation(block, temb)[3:]
    norm_hidden_states = (block.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(
        hidden_states)
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def _part(function, *args: torch.Tensor) -> torch.Tensor:
    """``function(*args)`` as its own non-reentrant checkpoint when autograd records (else plainly: sampling,
    validation)."""
    if not torch.is_grad_enabled():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=False)


def lean_block_forward(block: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       temb: torch.Tensor, rotary_emb: torch.Tensor) -> torch.Tensor:
    """``WanTransformerBlock.forward`` in three checkpointed parts, the FFN over token chunks (module docstring)."""
    hidden_states = _part(functools.partial(_self_attention, block), hidden_states, temb, rotary_emb)
    hidden_states = _part(functools.partial(_cross_attention, block), hidden_states, encoder_hidden_states)
    feed_forward = functools.partial(_feed_forward, block)
    tokens = hidden_states.shape[1]
    if tokens <= FFN_CHUNK_TOKENS:
        return _part(feed_forward, hidden_states, temb)
    chunks = []
    for start in range(0, tokens, FFN_CHUNK_TOKENS):
        end = min(start + FFN_CHUNK_TOKENS, tokens)
        chunks.append(_part(feed_forward, hidden_states[:, start:end],
                            temb[:, start:end] if temb.ndim == 4 else temb))
    return torch.cat(chunks, dim=1)


class _UpcastLinear(torch.autograd.Function):
    """``F.linear(x.float(), weight)`` that keeps ``x`` as it came (bf16) for the backward and casts it again there,
    instead of keeping the float32 copy (what peft's LoRA does: it casts its input to the fp32 ``lora_A`` weight's
    dtype, and ``lora_A`` saves that copy, once per projection: three of them for q, k and v)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            x2d, grad2d = x.reshape(-1, x.shape[-1]).to(weight.dtype), grad.reshape(-1, grad.shape[-1])
            grad_weight = x2d.t().mm(grad2d).t()
        return grad_x, grad_weight


def _upcast_forward(linear: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _UpcastLinear.apply(x, linear.weight)
    return forward


def lean_lora_inputs(block: nn.Module) -> int:
    """Let the plain LoRA layers of ``block`` keep their bf16 input for ``lora_A``'s backward instead of peft's
    float32 copy (:class:`_UpcastLinear`; the same product). Only layers with one adapter, no dropout and no
    variant (DoRA) and a bias-free ``lora_A``: the others keep peft's path. Returns the layers changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in block.modules():
        if not isinstance(module, LoraLayer) or len(module.lora_A) != 1 or getattr(module, "lora_variant", None):
            continue
        (name, lora_a), = module.lora_A.items()
        if not isinstance(module.lora_dropout[name], nn.Identity) or lora_a.bias is not None:
            continue
        module.cast_input_dtype_enabled = False
        lora_a.forward = _upcast_forward(lora_a)
        changed += 1
    return changed


class LeanWanTransformerBlock(WanTransformerBlock):
    """A ``WanTransformerBlock`` whose forward is :func:`lean_block_forward` (same parameters, same state dict)."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                rotary_emb: torch.Tensor) -> torch.Tensor:
        return lean_block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)


class LeanWanVACETransformerBlock(WanVACETransformerBlock):
    """A VACE block (``WanVACETransformerBlock``: a main block's arithmetic on the control stream, between
    ``proj_in`` and ``proj_out``) whose body is :func:`lean_block_forward` (same parameters, same state dict)."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                control_hidden_states: torch.Tensor, temb: torch.Tensor,
                rotary_emb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.proj_in is not None:
            control_hidden_states = self.proj_in(control_hidden_states) + hidden_states
        control_hidden_states = lean_block_forward(self, control_hidden_states, encoder_hidden_states, temb,
                                                   rotary_emb)
        hint = self.proj_out(control_hidden_states) if self.proj_out is not None else None
        return hint, control_hidden_states


def use_recompute(transformer: nn.Module, mode: str) -> int:
    """Give every block of ``transformer`` the recompute of ``mode``: ``block`` leaves diffusers' blocks as they are,
    ``lean`` makes them :class:`LeanWanTransformerBlock` (VACE blocks :class:`LeanWanVACETransformerBlock`) and
    lets their plain LoRA layers keep bf16 inputs (:func:`lean_lora_inputs`). After the adapter is added (peft's
    layers exist) and before ``compile.compile_blocks`` (which compiles ``type(block).forward``). Returns the number
    of lean main blocks."""
    if mode not in ("block", "lean"):
        raise ValueError(f"recompute mode {mode!r} is not 'block' or 'lean' ('auto' is resolved by the planner)")
    if mode == "lean":
        for block in transformer.blocks:
            if type(block) is WanTransformerBlock:
                block.__class__ = LeanWanTransformerBlock
                lean_lora_inputs(block)
        for block in getattr(transformer, "vace_blocks", ()):  # VACE variants: the VACE blocks alike
            if type(block) is WanVACETransformerBlock:
                block.__class__ = LeanWanVACETransformerBlock
                lean_lora_inputs(block)
    return sum(type(block) is LeanWanTransformerBlock for block in transformer.blocks)
