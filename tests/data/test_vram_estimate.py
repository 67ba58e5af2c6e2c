"""The VRAM estimate covers what the transformer really keeps for backward, per configuration it covers (base
dtype fp32 / bf16 / fp8 storage, gradient checkpointing on / off), measured with ``saved_tensors_hooks`` on a
narrow model with A14B's proportions (bench/measure_block_activations.py; the figures in ``data/report.py`` come
from the same measurement at the real width)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from wantrain.data.report import activation_bytes, block_saved_bytes

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "measure_block_activations.py"
WIDTH, HEADS, FFN = 640, 5, 1728  # head dim 128 and ffn = 2.7 x width, as in A14B
NAMES = {"bf16": "bf16 base, fp32 LoRA", "fp32": "fp32 base, fp32 LoRA", "fp8": "fp8 base, fp32 LoRA"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("measure_block_activations", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(bench, base_dtype, blocks=1, checkpointing=False):
    _, lora_dtype, fp8 = bench.CONFIGURATIONS[NAMES[base_dtype]]
    return bench.build(WIDTH, HEADS, FFN, blocks, base_dtype, lora_dtype, fp8, checkpointing=checkpointing)


def _block_params(model) -> int:
    return sum(p.numel() for p in model.blocks[0].parameters() if not p.requires_grad)


@pytest.mark.parametrize("base_dtype", ["bf16", "fp32", "fp8"])
def test_the_estimate_of_one_block_covers_what_it_saves_for_backward(bench, base_dtype):
    model = _model(bench, base_dtype)
    for frames in (1, 2):
        measured = bench.saved_bytes(model, frames, 16, base_dtype, block_only=True)
        estimate = block_saved_bytes(bench.tokens_of(frames, 16), WIDTH, base_dtype, text_tokens=512,
                                     block_params=_block_params(model))
        assert measured <= estimate < 1.5 * measured  # covers it, and not by much


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_the_activation_estimate_covers_a_whole_forward(bench, base_dtype, checkpointing):
    blocks, frames = 2, 2
    model = _model(bench, base_dtype, blocks=blocks, checkpointing=checkpointing)
    measured = bench.saved_bytes(model, frames, 16, base_dtype, block_only=False)
    if checkpointing:  # the backward recomputes one block at a time, which then keeps what a block keeps
        measured += bench.saved_bytes(_model(bench, base_dtype), frames, 16, base_dtype, block_only=True)
    text_input = 512 * 4096 * 2  # the estimate's own line for the cached text context
    estimate = activation_bytes(bench.tokens_of(frames, 16), WIDTH, blocks, base_dtype, checkpointing,
                                text_tokens=512, block_params=_block_params(model)) + text_input
    assert measured <= estimate


def _saved_bf16_weight_copies(model) -> int:
    """How many tensors saved for backward in one forward are bf16 copies of a frozen float8 Linear weight."""
    import torch

    shapes = {tuple(m.weight.shape) for m in model.modules()
              if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn}
    resident = [p.detach() for p in model.parameters()]
    params = {t.untyped_storage().data_ptr() for t in resident}
    copies = {}

    def pack(t):
        if (t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
                and t.untyped_storage().data_ptr() not in params):
            copies[t.untyped_storage().data_ptr()] = t
        return t

    x = torch.randn(1, 16, 1, 16, 16).to(torch.bfloat16)
    text = torch.randn(1, 512, 4096).to(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)
    return len(copies)


def test_fp8_storage_without_checkpointing_keeps_a_bf16_copy_of_every_frozen_linear(bench):
    """Why ``base_dtype = "fp8"`` needs gradient checkpointing: layerwise casting computes each Linear from a bf16
    copy of its float8 weight, and autograd keeps that copy for the backward, in every block; with checkpointing
    the forward keeps only block inputs (the copies live one block at a time, in the recompute)."""
    # a Linear keeps its weight when its input needs a gradient: 8 of a block's 10 (cross-attention k/v read the
    # text), 5 in the first block (its self-attention q/k/v read the frozen patch embedding)
    assert _saved_bf16_weight_copies(_model(bench, "fp8", blocks=2)) == 5 + 8
    assert _saved_bf16_weight_copies(_model(bench, "fp8", blocks=2, checkpointing=True)) == 0
