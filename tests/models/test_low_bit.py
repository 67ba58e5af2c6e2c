"""Low-bit frozen bases (``model.base_dtype = "int8"`` / ``"nf4"``, models/wan22/lowbit.py): every adapter type
trains on them, the plan counts their bytes tensor by tensor, and DoRA (on these and on fp8) reads the dequantised
base weight."""

from __future__ import annotations

import pytest
import torch

from tests.models.wan22_helpers import make_adapter, raw_batch, train_steps
from wantrain.models.wan22.lowbit import LowBitLinear, dequantise, quantise
from wantrain.models.wan22.memory import host_tensor_bytes


# LoRA and DoRA: the runs' test (tests/test_waiting_expert_runs.py)
@pytest.mark.parametrize("base_dtype, kinds", [("int8", ("lokr",)), ("nf4", ("loha",))])
def test_lokr_and_loha_train_on_a_low_bit_base_counted_as_the_plan_counts_it(base_dtype, kinds):
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
    codes, absmax, scale = quantise(weight, kind)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 256 if kind == "int8" else 128)
    back = dequantise(codes, absmax, kind, (64, 256), torch.bfloat16, scale)
    error = ((back.float() - weight.float()).norm() / weight.float().norm()).item()
    assert 0 < error < bound


def _dequantised(base: torch.nn.Module) -> torch.Tensor:
    """The weight ``base``'s forward computes with, float32, dequantised whole by each storage's own formula (not
    through ``adapter_types.base_rows``): bf16-rounded codes x column scales, bf16-rounded fp8 x row scales, or
    the float8 weight of layerwise casting as it is (exact in bf16)."""
    from wantrain.models.wan22.fp8 import ScaledFp8Linear

    if isinstance(base, LowBitLinear):
        return dequantise(base.weight_codes, base.weight_absmax, base.kind, (base.out_features, base.in_features),
                          torch.bfloat16, base.weight_column_scale).float()
    if isinstance(base, ScaledFp8Linear):
        return (base.weight.float() * base.weight_scale).to(torch.bfloat16).float()
    assert base.weight.dtype == torch.float8_e4m3fn
    return base.weight.float()


@pytest.mark.parametrize("base_dtype", ["fp8", "fp8_scaled", "int8", "nf4"])
def test_doras_magnitude_row_norms_forward_and_export_on_a_quantised_base_use_its_dequantised_weight(base_dtype,
                                                                                                    monkeypatch):
    """DoRA reads the base weight outside its forward (its row norms, its start, its export): on fp8 and low-bit
    storage the dequantised rows (``adapter_types.base_rows``), a few rows at a time, never the stored codes or the
    low-bit stand-in."""
    from wantrain.models.wan22 import adapter as adapter_module
    from wantrain.models.wan22 import adapter_forward
    from wantrain.models.wan22.adapter_types import ADAPTER_NAME, F32_EPS
    from wantrain.models.wan22.export import lora_layers, wan_module_name

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))  # fp8 runs need CUDA; its math is here
    monkeypatch.setattr(adapter_forward, "NORM_ROWS", 5)  # row blocks that cut every weight unevenly
    adapter = make_adapter("tiny-t2v", base_dtype=base_dtype, lora={"type": "dora", "dropout": 0.0}, switch_every=1,
                           gradient_checkpointing=True, experts="high_noise")
    transformer = adapter.transformer_for("high_noise")
    layers = dict(lora_layers(transformer))
    assert len(layers) == 20
    for layer in layers.values():  # the start: m = the dequantised base rows' norms (a stand-in's would be 0)
        weight = _dequantised(layer.get_base_layer())
        assert torch.allclose(layer.lora_magnitude_vector[ADAPTER_NAME].weight, weight.norm(dim=1), rtol=1e-6)
    train_steps(adapter, adapter.encode_batch(raw_batch()), steps=2, lr=1e-2)
    exported = adapter.adapter_tensors("high_noise", torch.float32)
    x = torch.randn(3, transformer.config.num_attention_heads * transformer.config.attention_head_dim,
                    generator=torch.Generator().manual_seed(2))
    for name, layer in layers.items():
        base = layer.get_base_layer()
        weight, b, a = _dequantised(base), layer.lora_B[ADAPTER_NAME].weight, layer.lora_A[ADAPTER_NAME].weight
        scaling = layer.scaling[ADAPTER_NAME]
        adapted = torch.linalg.norm(weight + scaling * (b @ a), dim=1)
        assert b.abs().max() > 0 and torch.allclose(adapter_forward.dora_row_norms(base, b, a, scaling), adapted,
                                                    rtol=1e-6), name
        magnitude = layer.lora_magnitude_vector[ADAPTER_NAME].weight.detach()
        expected = magnitude * (weight.norm(dim=1) + F32_EPS) / adapted
        assert torch.allclose(exported[f"{wan_module_name(name)}.dora_scale"].view(-1), expected, rtol=1e-5), name
        if name.endswith("attn1.to_q"):  # the forward: m / ||W + s B A|| * (W + s B A) x + bias, W dequantised
            with torch.no_grad():
                got = layer(x.to(torch.bfloat16)).float()
                want = (x @ (weight + scaling * (b @ a)).T) * (magnitude / adapted) + base.bias.float()
            assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item()), name


def test_the_memory_plan_states_what_a_quantised_storage_costs_in_quality():
    from wantrain.models.wan22.memory import MemorySettings, estimate

    def lines(base_dtype: str) -> str:
        return "\n".join(estimate("tiny-t2v", MemorySettings(base_dtype), width=32, height=32, frames=9,
                                  rank=4).lines())

    assert "base quality: int8 moves a real-width A14B Linear's output 0.70 % from exact (0.71 %" in lines("int8")
    assert "base quality: nf4" in lines("nf4") and "base quality" not in lines("bf16")


def test_auto_storage_takes_nf4_for_the_card_only_where_no_bf16_or_fp8_plan_fits():
    """A 12 GiB card, A14B at 832x480x77: fp8's smallest setting needs more than 12 GiB, so ``base_dtype = "auto"``
    goes on to the low-bit storages (``low_bit``: bitsandbytes installed) and fits nf4; with room, bf16 as before."""
    from wantrain.models.wan22.memory import MemorySettings, auto_dtypes, estimate, plan

    size = dict(width=832, height=480, frames=77, rank=32)
    assert auto_dtypes(True) == ("bf16", "fp8", "int8", "nf4") and auto_dtypes(False) == ("bf16", "fp8")
    assert estimate("t2v-a14b", MemorySettings("fp8", 40, True, "lean"), **size).device_gib > 12.0
    chosen, _ = plan("t2v-a14b", 12.0, base_dtype="auto", low_bit=True, **size)
    assert chosen.settings.base_dtype == "nf4" and chosen.device_gib <= 12.0
    assert plan("t2v-a14b", 24.0, base_dtype="auto", low_bit=True, **size)[0].settings.base_dtype == "bf16"


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_weight_quantised_a_few_rows_at_a_time_has_the_whole_tensors_codes(kind, monkeypatch):
    """On the CPU ``quantise`` goes ``CPU_CHUNK_WEIGHTS`` weights at a time (bitsandbytes' CPU nf4 quantiser takes
    ~14 bytes per weight at once); a block of 64 never crosses a row, so the codes are bit for bit the same."""
    from wantrain.models.wan22 import lowbit

    weight = (torch.randn(50, 192, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    whole = quantise(weight, kind)
    monkeypatch.setattr(lowbit, "CPU_CHUNK_WEIGHTS", 3 * 192)  # 17 chunks of 3 rows (the last one of 2)
    chunked = quantise(weight, kind)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
    assert lowbit._chunk_rows(weight) == 3 and lowbit._chunk_rows(weight[:, :100]) == 50  # rows of whole blocks only


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_estimate_of_a_low_bit_base_is_within_five_percent_of_a_traced_step(kind):
    """Two real-width A14B blocks at 832x480x33 with one swapped, activation offload and the lean recompute, the
    Linears as bitsandbytes codes dequantised in each forward (bench/trace_memory.py --dtype int8|nf4; the whole
    40-block plans at 832x480x81 are +4.7 % over their traces, docs/models.md)."""
    import importlib.util
    from pathlib import Path

    from wantrain.models.wan22.memory import GIB, MemorySettings, estimate

    path = Path(__file__).resolve().parents[2] / "bench" / "trace_memory.py"
    spec = importlib.util.spec_from_file_location("trace_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    traced = module.trace("t2v-a14b", kind, 1, True, (832, 480, 33), rank=32, layers=2, recompute="lean")
    est = estimate("t2v-a14b", MemorySettings(kind, 1, True, "lean"), width=832, height=480, frames=33, rank=32,
                   layers=2)
    assert abs(est.allocated / GIB / traced["peak_gib"] - 1) < 0.05, (est.parts, traced)
