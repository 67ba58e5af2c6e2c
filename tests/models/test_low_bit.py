"""Low-bit frozen bases (``model.base_dtype = "int8"`` / ``"nf4"``, models/wan22/lowbit.py): every adapter type but
DoRA trains on them, the plan counts their bytes tensor by tensor, and DoRA is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.models.wan22_helpers import make_adapter, raw_batch, train_steps
from wantrain.core.errors import ConfigError
from wantrain.models.wan22.lowbit import LowBitLinear, dequantise, quantise
from wantrain.models.wan22.memory import host_tensor_bytes


@pytest.mark.parametrize("base_dtype, kinds", [("int8", ("lokr",)), ("nf4", ("loha",))])  # LoRA: the runs' test
def test_every_adapter_type_but_dora_trains_on_a_low_bit_base_counted_as_the_plan_counts_it(base_dtype, kinds):
    for kind in kinds:
        adapter = make_adapter("tiny-t2v", base_dtype=base_dtype, lora={"type": kind}, blocks_to_swap=1,
                               offload_activations=True, recompute="lean", switch_every=1)
        high = adapter.transformer_for("high_noise")
        assert sum(isinstance(m, LowBitLinear) for m in high.modules()) == 20  # 10 Linears in each of 2 blocks
        before = [p.detach().clone() for p in adapter.trainable_parameters()]
        train_steps(adapter, adapter.encode_batch(raw_batch()), steps=2, lr=1e-2)
        after = adapter.trainable_parameters()
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), kind
        assert all(torch.isfinite(p).all() for p in after)
    rest, blocks = host_tensor_bytes("tiny-t2v", base_dtype)
    low = adapter.transformer_for("low_noise")  # frozen: the base, without the adapter's trained factors
    frozen = sum(t.numel() * t.element_size() for t in [*low.parameters(), *low.buffers()] if not t.requires_grad)
    assert frozen == sum(rest) + sum(s for block in blocks for s in block)


@pytest.mark.parametrize("kind, bound", [("int8", 0.02), ("nf4", 0.15)])
def test_the_dequantised_weight_is_near_the_original(kind, bound):
    weight = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    codes, absmax = quantise(weight, kind)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 256 if kind == "int8" else 128)
    back = dequantise(codes, absmax, kind, (64, 256), torch.bfloat16)
    error = ((back.float() - weight.float()).norm() / weight.float().norm()).item()
    assert 0 < error < bound


def test_compiled_blocks_on_a_low_bit_base_are_refused_in_one_line():
    from wantrain.models.wan22 import ModelConfig

    with pytest.raises(ConfigError, match="model.base_dtype = 'nf4' with model.compile = 'default': bitsandbytes"):
        ModelConfig(variant="tiny-t2v", base_dtype="nf4", compile="default")


def test_dora_on_a_low_bit_base_is_refused_in_one_line(tmp_path):
    from wantrain.app.config import load_config

    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\nbase_dtype = "nf4"\n[lora]\ntype = "dora"\n')
    with pytest.raises(ConfigError, match="lora.type = 'dora' reads the base weights") as err:
        load_config(config)
    assert "\n" not in str(err.value)


def test_the_memory_plan_states_what_a_quantised_storage_costs_in_quality():
    from wantrain.models.wan22.memory import MemorySettings, estimate

    def lines(base_dtype: str) -> str:
        return "\n".join(estimate("tiny-t2v", MemorySettings(base_dtype), width=32, height=32, frames=9,
                                  rank=4).lines())

    assert "base quality: int8 moves a real-width A14B Linear's output 0.70 % from exact (1.06 %" in lines("int8")
    assert "base quality: nf4" in lines("nf4") and "base quality" not in lines("bf16")
