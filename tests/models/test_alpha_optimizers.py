"""A `preserve_output` alpha transition with every built-in optimizer on the tiny Wan model: the output is
continuous (<= 1e-6 relative), the optimizer's next update of B′ is the one it would have made on B (so c = α′/α
times larger in the output: the documented factor), A's update does not change, and an optimizer whose state has no
known map is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from test_wan22_round_trip import _inputs
from wan22_helpers import make_adapter, raw_batch

from wantrain.models.wan22.export import ADAPTER_NAME, lora_layers
from wantrain.optimizers import OptimizerConfig, build_optimizer

EXPERT = "high_noise"
KEYS = {  # adamw8bit: min_8bit_size 16, or the tiny LoRA's tensors would keep fp32 state (tested separately)
    "adamw": {}, "adamw8bit": {"arguments": {"min_8bit_size": 16}}, "adamw8bit_fp32": {}, "adafactor": {"beta1": 0.9},
    "adamw_schedulefree": {},
}
OLD, NEW = 4.0, 14.0


def _setup(kind):
    torch.manual_seed(0)
    adapter = make_adapter("tiny-t2v", rank=4, alpha=OLD, switch_every=1, gradient_checkpointing=False,
                           lora={"save_dtype": "fp32"}, experts=EXPERT)
    cfg = OptimizerConfig(type=kind.removesuffix("_fp32"), lr=1e-2, **KEYS[kind])
    optimizer = build_optimizer(cfg, adapter.param_groups(), torch.device("cpu"))
    if callable(getattr(optimizer, "train", None)):
        optimizer.train()
    batch = adapter.encode_batch(raw_batch())
    adapter.activate(EXPERT, optimizer)
    for step in range(3):  # some optimizer state to rescale
        _step(adapter, optimizer, batch, seed=step)
    return adapter, optimizer, batch


def _step(adapter, optimizer, batch, seed):
    adapter.loss(batch, EXPERT, torch.Generator().manual_seed(100 + seed)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _output(adapter):
    transformer = adapter.transformer_for(EXPERT)
    was = transformer.training
    transformer.eval()
    with torch.no_grad():
        out = transformer(**_inputs(adapter, EXPERT))[0]
    transformer.train(was)
    return out


def _weights(adapter, which):
    return [getattr(layer, which)[ADAPTER_NAME].weight.detach().clone()
            for _, layer in lora_layers(adapter.transformer_for(EXPERT))]


@pytest.mark.parametrize("kind", list(KEYS))
def test_preserve_output_keeps_the_output_and_the_next_update_with_every_optimizer(kind):
    adapter, optimizer, batch = _setup(kind)
    twin_adapter, twin_optimizer, _ = _setup(kind)  # the same run (deterministic on the CPU) without the transition
    before = _output(adapter)
    adapter.change_lora_alpha(NEW, EXPERT, optimizer, preserve_output=True)
    after = _output(adapter)
    assert ((after - before).norm() / before.norm()).item() <= 1e-6
    c = NEW / OLD
    if kind.startswith("adamw8bit"):  # both of bitsandbytes' paths: quantized codes with block scales, and fp32
        dtypes = {optimizer.state[p]["state1"].dtype for g in optimizer.param_groups for p in g["params"]
                  if optimizer.state.get(p)}
        assert dtypes == ({torch.uint8} if kind == "adamw8bit" else {torch.float32}), dtypes
    b_weights = [layer.lora_B[ADAPTER_NAME].weight for _, layer in lora_layers(adapter.transformer_for(EXPERT))]
    if kind == "adamw_schedulefree":  # the weight is y, a mix of x and z: z follows B (÷ c), and so do x and y
        twin_b = [layer.lora_B[ADAPTER_NAME].weight
                  for _, layer in lora_layers(twin_adapter.transformer_for(EXPERT))]
        for b, twin in zip(b_weights, twin_b, strict=True):
            torch.testing.assert_close(optimizer.state[b]["z"], twin_optimizer.state[twin]["z"] / c)
            torch.testing.assert_close(optimizer.state[b]["exp_avg_sq"], twin_optimizer.state[twin]["exp_avg_sq"]
                                       * c * c)
    watched = "z" if kind == "adamw_schedulefree" else None

    def moved(a, opt):  # what the next step changes: B and A (schedule-free: their z, its gradient step)
        layers = [layer for _, layer in lora_layers(a.transformer_for(EXPERT))]
        params = [lay.lora_B[ADAPTER_NAME].weight for lay in layers] + [lay.lora_A[ADAPTER_NAME].weight
                                                                          for lay in layers]
        return [(opt.state[p][watched] if watched else p).detach().clone() for p in params]

    start, twin_start = moved(adapter, optimizer), moved(twin_adapter, twin_optimizer)
    _step(adapter, optimizer, batch, seed=9)
    _step(twin_adapter, twin_optimizer, batch, seed=9)
    # the optimizer's step on B' is the one it made on B (so c times larger in the output); on A it is unchanged
    for new, new0, old, old0 in zip(moved(adapter, optimizer), start, moved(twin_adapter, twin_optimizer),
                                    twin_start, strict=True):
        assert (old - old0).abs().max() > 0  # the step moved something: "equal" is not vacuous
        torch.testing.assert_close(new - new0, old - old0, rtol=5e-3, atol=1e-6 * (old - old0).abs().max().item())


def test_an_optimizer_state_without_a_map_is_refused_before_any_layer_changes():
    adapter, optimizer, _ = _setup("adamw")
    layers = [layer for _, layer in lora_layers(adapter.transformer_for(EXPERT))]
    last = layers[-1].lora_B[ADAPTER_NAME].weight
    optimizer.state[last]["lr_mask"] = torch.ones_like(last)  # automagic-like state no map knows
    b_before = _weights(adapter, "lora_B")
    with pytest.raises(TypeError, match="lr_mask"):
        adapter.change_lora_alpha(NEW, EXPERT, optimizer, preserve_output=True)
    for now, was in zip(_weights(adapter, "lora_B"), b_before, strict=True):
        assert torch.equal(now, was)  # the check pass ran over every layer first: nothing was rescaled
    assert adapter.lora_alpha(EXPERT) == OLD
