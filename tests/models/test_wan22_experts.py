"""Experts: timestep bands, the switch schedule, parameter groups, and where the inactive expert waits.

What CPU tests can show about offloading: there is one real device here, so "moved off the training device" is
checked by giving the adapter a distinct offload device (``meta``) at the end of a run and asserting that every
tensor of the inactive expert (base weights, LoRA, AdamW moments) went there and none of the active one's did.
Whether the transfer frees GPU memory is only observable on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch
from wan22_helpers import make_adapter, raw_batch, train_steps

from wantrain.core.errors import ConfigError, UserError
from wantrain.models.wan22 import ModelConfig
from wantrain.models.wan22.timesteps import Band, TimestepSampler, expert_band


def _timesteps_seen(adapter, expert, batch, calls=8):
    seen = []
    handle = adapter.transformer_for(expert).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].detach().clone()), with_kwargs=True
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(calls):
            adapter.loss(batch, expert, generator)
    handle.remove()
    return torch.cat(seen)


@pytest.mark.parametrize("variant,boundary", [("tiny-t2v", 875.0), ("tiny-i2v", 900.0)])
def test_every_timestep_the_model_sees_lies_in_its_experts_range(variant, boundary):
    adapter = make_adapter(variant, shift=5.0, gradient_checkpointing=False)
    batch = adapter.encode_batch(raw_batch(batch_size=2))
    batch = {k: v.repeat(8, *([1] * (v.dim() - 1))) for k, v in batch.items()}  # 16 samples per call
    high = _timesteps_seen(adapter, "high_noise", batch)
    low = _timesteps_seen(adapter, "low_noise", batch)
    assert high.min() >= boundary and high.max() <= 1000.0
    assert low.min() >= 0.0 and low.max() < boundary


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "sigmoid"])
@pytest.mark.parametrize("shift", [1.0, 3.0, 12.0])
def test_band_sampling_keeps_the_shape_of_the_shifted_distribution(method, shift):
    sampler = TimestepSampler(method=method, shift=shift, std=1.3 if method == "sigmoid" else 1.0)
    g = torch.Generator().manual_seed(0)
    full = sampler.sample(400_000, Band(low=0.0, high=1.0), g, torch.device("cpu"))
    band = expert_band(0.875, "high_noise", None, 0.97)
    rejected = full[(full >= band.low) & (full <= band.high)]  # the reference: rejection sampling
    ours = sampler.sample(rejected.numel(), band, g, torch.device("cpu"))
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    assert torch.allclose(ours.quantile(q), rejected.quantile(q), atol=2e-3)
    assert ours.min() >= band.low and ours.max() <= band.high


def test_same_generator_state_gives_the_same_loss():
    adapter = make_adapter("tiny-t2v")
    batch = adapter.encode_batch(raw_batch())
    losses = [adapter.loss(batch, "high_noise", torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(losses[0], losses[1])


def test_min_t_outside_the_trained_experts_range_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"model\.min_t = 0\.5 .*high_noise: 0\.875\.\.1") as err:
        ModelConfig(variant="t2v-a14b", experts="high_noise", min_t=0.5)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.max_t"):
        ModelConfig(variant="i2v-a14b", experts="low_noise", max_t=0.95)
    with pytest.raises(ConfigError, match="high-noise expert nothing to train"):
        ModelConfig(variant="i2v-a14b", experts="both", max_t=0.9)
    assert ModelConfig(variant="i2v-a14b", experts="low_noise", min_t=0.1, max_t=0.9).max_t == 0.9


def test_single_transformer_variant_rejects_an_expert_choice():
    with pytest.raises(ConfigError, match="one transformer"):
        ModelConfig(variant="ti2v-5b", experts="low_noise")


def test_trained_expert_switches_exactly_every_switch_every_steps():
    adapter = make_adapter("tiny-t2v", switch_every=3)
    experts = [adapter.expert_for_step(step) for step in range(1, 13)]
    assert experts == ["high_noise"] * 3 + ["low_noise"] * 3 + ["high_noise"] * 3 + ["low_noise"] * 3
    only_low = make_adapter("tiny-t2v", experts="low_noise")
    assert only_low.experts == ("low_noise",)
    assert {only_low.expert_for_step(s) for s in range(1, 30)} == {"low_noise"}
    assert make_adapter("tiny-ti2v").experts == (None,)


def test_each_expert_has_its_own_named_parameter_group_and_lr():
    adapter = make_adapter("tiny-t2v", lr=1e-4, lr_low_noise=5e-5)
    groups = adapter.param_groups()
    assert [(g["name"], g["lr"]) for g in groups] == [("high_noise", 1e-4), ("low_noise", 5e-5)]
    high_ids = {id(p) for p in groups[0]["params"]}
    assert high_ids.isdisjoint(id(p) for p in groups[1]["params"])
    assert len(groups[0]["params"]) == 2 * 10 * 2  # 2 blocks x 10 Linears x (A, B)
    single = make_adapter("tiny-ti2v").param_groups()
    assert [g["name"] for g in single] == ["lora"]


def test_inactive_expert_is_not_updated_and_waits_on_the_offload_device():
    adapter = make_adapter("tiny-t2v", switch_every=1)
    batch = adapter.encode_batch(raw_batch())
    optimizer = train_steps(adapter, batch, steps=2, lr=1e-2)  # both experts now have AdamW state
    low_before = [p.detach().clone() for p in adapter.trainable_parameters("low_noise")]
    high_before = [p.detach().clone() for p in adapter.trainable_parameters("high_noise")]

    adapter.activate("high_noise", optimizer)
    adapter.loss(batch, "high_noise", torch.Generator().manual_seed(2)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(low_before, adapter.trainable_parameters("low_noise"), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(high_before, adapter.trainable_parameters("high_noise"),
                                                      strict=True))

    adapter.offload_device = torch.device("meta")  # a device distinct from the training device (see docstring)
    adapter.activate("high_noise", optimizer)
    assert adapter.placement.where == {"high_noise": torch.device("cpu"), "low_noise": torch.device("meta")}
    low, high = adapter.transformer_for("low_noise"), adapter.transformer_for("high_noise")
    assert {p.device.type for p in low.parameters()} == {"meta"}
    assert {p.device.type for p in high.parameters()} == {"cpu"}
    low_state = [optimizer.state[p] for p in adapter.trainable_parameters("low_noise")]
    assert {s["exp_avg"].device.type for s in low_state} == {"meta"}
    assert {s["exp_avg_sq"].device.type for s in low_state} == {"meta"}
    high_state = [optimizer.state[p] for p in adapter.trainable_parameters("high_noise")]
    assert {s["exp_avg"].device.type for s in high_state} == {"cpu"}


def test_fp8_base_weights_on_cpu_are_a_one_line_error():
    with pytest.raises(UserError, match="base_dtype = 'fp8' needs a CUDA device"):
        make_adapter("tiny-t2v", base_dtype="fp8")


def test_adapter_satisfies_the_core_model_adapter_protocol():
    from wantrain.core.adapter import ModelAdapter

    assert isinstance(make_adapter("tiny-ti2v"), ModelAdapter)


def test_fp8_storage_keeps_lora_in_fp32_and_still_trains(monkeypatch):
    """The fp8 path (diffusers layerwise casting) exercised on the CPU, where it is allowed only for this test."""
    import wantrain.models.wan22.adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    adapter = make_adapter("tiny-t2v", base_dtype="fp8", experts="high_noise")
    to_q = adapter.transformer_for("high_noise").blocks[0].attn1.to_q
    assert to_q.base_layer.weight.dtype == torch.float8_e4m3fn
    assert {p.dtype for p in adapter.trainable_parameters()} == {torch.float32}
    batch = adapter.encode_batch(raw_batch())
    before = [p.detach().clone() for p in adapter.trainable_parameters()]
    train_steps(adapter, batch, steps=2, lr=1e-2)
    assert not all(torch.equal(a, b) for a, b in zip(before, adapter.trainable_parameters(), strict=True))


def test_an_fp8_run_starts_from_the_same_lora_as_a_bf16_run(monkeypatch):
    """peft casts a new LoRA to its base layer's dtype; through float8 ``A`` would keep a handful of values. The
    start is drawn in float32 from the run seed, whatever the base dtype."""
    import wantrain.models.wan22.adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    fp8 = make_adapter("tiny-t2v", base_dtype="fp8", experts="high_noise")
    bf16 = make_adapter("tiny-t2v", base_dtype="bf16", experts="high_noise")
    fp32 = make_adapter("tiny-t2v", base_dtype="fp32", experts="high_noise")
    named = [dict(a.transformer_for("high_noise").named_parameters()) for a in (fp8, bf16, fp32)]
    lora_a = [name for name in named[0] if ".lora_A." in name]
    assert len(lora_a) == 20
    for name in lora_a:
        assert torch.equal(named[0][name], named[1][name]) and torch.equal(named[1][name], named[2][name])
    first = named[0][lora_a[0]]
    assert first.dtype == torch.float32 and first.unique().numel() == first.numel()  # not rounded through fp8


def test_fp8_storage_without_gradient_checkpointing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"base_dtype = 'fp8' with model\.gradient_checkpointing = false keeps a "
                       r"bf16 copy of every frozen Linear") as err:
        ModelConfig(variant="t2v-a14b", base_dtype="fp8", gradient_checkpointing=False)
    assert "\n" not in str(err.value)
    assert ModelConfig(variant="t2v-a14b", base_dtype="fp8").gradient_checkpointing
