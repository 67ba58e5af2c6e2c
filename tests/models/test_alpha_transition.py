"""An alpha change on the tiny Wan model: `preserve_output` keeps the model's output (and Adam's next update in
the output's terms), `jump` scales the LoRA's contribution by new/old, and a LoRA saved after a transition loads
in diffusers with the trained behaviour."""

from __future__ import annotations

import pytest
import torch
from test_wan22_round_trip import _inputs
from wan22_helpers import make_adapter, raw_batch, train_steps

from wantrain.models.wan22.export import ADAPTER_NAME, lora_layers


def _trained(variant="tiny-t2v", **model):
    adapter = make_adapter(variant, rank=4, alpha=4.0, switch_every=1, gradient_checkpointing=False,
                           lora={"save_dtype": "fp32"}, **model)
    optimizer = train_steps(adapter, adapter.encode_batch(raw_batch()), steps=2 * len(adapter.experts), lr=2e-2)
    return adapter, optimizer


def _outputs(adapter, expert, scale=None):
    transformer = adapter.transformer_for(expert).eval()
    kwargs = _inputs(adapter, expert)
    if scale is not None:
        kwargs["attention_kwargs"] = {"scale": scale}
    with torch.no_grad():
        return transformer(**kwargs)[0]


def test_preserve_output_keeps_the_output_and_rescales_b_and_adam_moments():
    adapter, optimizer = _trained()
    expert = "high_noise"
    adapter.activate(expert, optimizer)
    before = _outputs(adapter, expert)
    base = _outputs(adapter, expert, scale=0.0)
    assert (before - base).abs().max() > 1e-3  # the LoRA matters, so "unchanged" is not vacuous
    layer = next(layer for _, layer in lora_layers(adapter.transformer_for(expert)))
    b = layer.lora_B[ADAPTER_NAME].weight
    b_before, m_before, v_before = b.detach().clone(), *(optimizer.state[b][k].clone() for k in ("exp_avg",
                                                                                                 "exp_avg_sq"))
    adapter.change_lora_alpha(14.0, expert, optimizer, preserve_output=True)
    after = _outputs(adapter, expert)
    rel = ((after - before).norm() / before.norm()).item()
    assert rel <= 1e-6, rel
    assert adapter.lora_alpha(expert) == 14.0 and adapter.lora_alpha("low_noise") == 4.0
    c = 14.0 / 4.0
    torch.testing.assert_close(b.detach(), b_before / c)
    torch.testing.assert_close(optimizer.state[b]["exp_avg"], m_before * c)
    torch.testing.assert_close(optimizer.state[b]["exp_avg_sq"], v_before * c * c)


def test_jump_scales_every_lora_layers_contribution_by_new_over_old_alpha():
    adapter, optimizer = _trained()
    expert = "low_noise"
    adapter.activate(expert, optimizer)
    before = _outputs(adapter, expert)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    layers = [layer for _, layer in lora_layers(adapter.transformer_for(expert))]

    def deltas():
        with torch.no_grad():
            return [layer(x[..., :layer.in_features]) - layer.base_layer(x[..., :layer.in_features])
                    for layer in layers if layer.in_features <= x.shape[-1]]

    old = deltas()
    assert old and all(d.abs().max() > 0 for d in old)
    adapter.change_lora_alpha(10.0, expert, optimizer, preserve_output=False)
    for new, was in zip(deltas(), old, strict=True):
        expected = was * (10.0 / 4.0)
        assert ((new - expected).norm() / expected.norm()).item() < 1e-5
    after = _outputs(adapter, expert)  # and the model's output jumps (the seed's discontinuity)
    assert ((after - before).norm() / before.norm()).item() > 1e-2


def test_other_optimizer_state_is_refused_not_silently_ignored():
    from wantrain.core.optim_state import check_rescalable

    with pytest.raises(TypeError, match="lr_mask"):
        check_rescalable("adam", {"lr_mask": torch.ones(3)})
    with pytest.raises(TypeError, match="no known way"):
        check_rescalable(None, {"d": torch.ones(3)})


@pytest.mark.slow
def test_lora_saved_after_a_transition_loads_in_diffusers_with_the_trained_behaviour(tiny_dir, tmp_path):
    import diffusers

    path = tiny_dir("tiny-t2v")
    adapter, optimizer = _trained(path=str(path))
    for expert in adapter.experts:
        adapter.change_lora_alpha(9.0, expert, optimizer, preserve_output=True)
    batch = adapter.encode_batch(raw_batch())
    generator = torch.Generator().manual_seed(5)
    for expert in adapter.experts:  # train on after the transition, so the saved B is not just a rescaled copy
        adapter.activate(expert, optimizer)
        adapter.loss(batch, expert, generator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    files = adapter.saver(tmp_path, "after").save(step=6, final=True)
    pipe = diffusers.WanPipeline.from_pretrained(str(path), local_files_only=True)
    for file, expert in zip(files, adapter.experts, strict=True):
        pipe.load_lora_weights(file, load_into_transformer_2=expert == "low_noise")
    for expert in adapter.experts:
        ours = _outputs(adapter, expert)
        theirs = (pipe.transformer_2 if expert == "low_noise" else pipe.transformer).eval()
        with torch.no_grad():
            got = theirs(**_inputs(adapter, expert))[0]
            base = theirs(**_inputs(adapter, expert), attention_kwargs={"scale": 0.0})[0]
        assert (ours - base).abs().max() > 1e-3
        assert (ours - got).abs().max().item() <= 1e-5
