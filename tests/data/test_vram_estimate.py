"""The planner's "one recomputed block" and "checkpointed inputs" (wantrain.models.wan22.memory, the one VRAM
estimate) cover what the transformer really keeps for backward, per base dtype (fp32 / bf16 / fp8 storage),
measured with ``saved_tensors_hooks`` on a narrow model with A14B's proportions (bench/measure_block_activations.py).
The real-width check of the whole step is tests/models/test_memory_plan.py (a fake-tensor trace)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from wantrain.models.wan22.memory import recompute_block_bytes

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "measure_block_activations.py"
WIDTH, HEADS, FFN = 640, 5, 1728  # head dim 128 and ffn = 2.7 x width, as in A14B
TEXT = 512
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


def _planned_block(bench, model, base_dtype, frames) -> float:
    """The planner's "one recomputed block" for this narrow block (fp8: plus its Linears' bf16 copies)."""
    import torch

    out = recompute_block_bytes(bench.tokens_of(frames, 16), WIDTH, FFN, TEXT)
    if base_dtype == "fp8":
        out += sum(m.weight.numel() * 2 for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear))
    return out


@pytest.mark.parametrize("base_dtype", ["bf16", "fp32", "fp8"])
def test_the_planned_recomputed_block_covers_what_it_saves_for_backward(bench, base_dtype):
    model = _model(bench, base_dtype)
    for frames in (1, 2):
        measured = bench.saved_bytes(model, frames, 16, base_dtype, block_only=True, text_tokens=TEXT)
        planned = _planned_block(bench, model, base_dtype, frames)
        assert measured <= planned < 1.5 * measured  # covers it, and not by much


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_the_planned_activations_cover_a_whole_checkpointed_forward(bench, base_dtype):
    blocks, frames = 2, 2
    model = _model(bench, base_dtype, blocks=blocks, checkpointing=True)
    measured = bench.saved_bytes(model, frames, 16, base_dtype, block_only=False, text_tokens=TEXT)
    # the backward recomputes one block at a time, which then keeps what a block keeps
    measured += bench.saved_bytes(_model(bench, base_dtype), frames, 16, base_dtype, block_only=True,
                                  text_tokens=TEXT)
    inputs = blocks * bench.tokens_of(frames, 16) * WIDTH * 2  # "checkpointed inputs": bf16 block inputs
    text_input = TEXT * 4096 * 2  # the cached text context ("workspace")
    assert measured <= inputs + _planned_block(bench, model, base_dtype, frames) + text_input


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
