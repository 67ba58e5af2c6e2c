"""model.recompute: the lean block recompute (``models/wan22/recompute.py``) against diffusers' whole-block one, on
the tiny twin; the planner's choice of the path is in test_memory_plan.py."""

from __future__ import annotations

import pytest
import torch
from wan22_helpers import make_adapter, raw_batch

from wantrain.core.errors import ConfigError
from wantrain.models.wan22 import ModelConfig, recompute
from wantrain.models.wan22.recompute import LeanWanTransformerBlock, use_recompute


def _gradients(adapter, batch) -> list[torch.Tensor]:
    expert = adapter.experts[0]
    adapter.activate(expert, None)
    adapter.loss(batch, expert, torch.Generator().manual_seed(1)).backward()
    params = adapter.trainable_parameters(expert)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


@pytest.fixture(scope="module")
def batch():
    return make_adapter(experts="high_noise").encode_batch(raw_batch(size=16, frames=5))


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "dora"])
def test_lean_recompute_gives_the_whole_block_recomputes_gradients_for_every_adapter_type_with_swap_and_offload(
        kind, batch, monkeypatch):
    # FFN chunks of 7 tokens: several chunks, the last one short (the tiny twin's 80 tokens)
    monkeypatch.setattr(recompute, "FFN_CHUNK_TOKENS", 7)
    adapter = make_adapter(lora={"type": kind}, experts="high_noise", blocks_to_swap=1, offload_activations=True,
                           pin_host_copies=False)
    transformer = adapter.transformer_for("high_noise")
    assert not any(isinstance(b, LeanWanTransformerBlock) for b in transformer.blocks)  # 'auto', no budget: block
    whole = _gradients(adapter, batch)
    assert use_recompute(transformer, "lean") == len(transformer.blocks)
    lean = _gradients(adapter, batch)
    # the same ops on the same values: bitwise (the tiny twin computes in fp32, where the chunked FFN's smaller
    # matmuls sum in the same order on this CPU)
    assert len(lean) == len(whole) and all(torch.equal(a, b) for a, b in zip(lean, whole, strict=True))
    assert any(g.abs().sum() > 0 for g in lean)


def test_lean_recompute_in_bf16_keeps_the_lora_input_in_bf16_and_the_same_gradients(batch, monkeypatch):
    monkeypatch.setattr(recompute, "FFN_CHUNK_TOKENS", 7)
    adapter = make_adapter(experts="high_noise", base_dtype="bf16", recompute="lean")
    transformer = adapter.transformer_for("high_noise")
    to_q = transformer.blocks[0].attn1.to_q
    assert isinstance(transformer.blocks[0], LeanWanTransformerBlock) and to_q.cast_input_dtype_enabled is False
    lean = _gradients(adapter, batch)
    whole = _gradients(make_adapter(experts="high_noise", base_dtype="bf16", recompute="block"), batch)
    # bf16 activations, fp32 LoRA: the LoRA input cast again in the backward gives the products peft's float32
    # copy gave, and the FFN chunks' matmuls sum in the same order on this CPU (a GPU's GEMM may pick another
    # kernel for the chunk's shape: within bf16 rounding there)
    assert all(torch.equal(a, b) for a, b in zip(lean, whole, strict=True))


def test_lean_recompute_without_gradient_checkpointing_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"model.recompute = 'lean' .* needs model.gradient_checkpointing = true"):
        ModelConfig(variant="tiny-t2v", recompute="lean", gradient_checkpointing=False)
