"""LoRA+ (``lora.plus_lr_ratio``): each expert's B matrices in a parameter group of their own at ratio x the LR."""

from __future__ import annotations

from wan22_helpers import make_adapter

from wantrain.models.wan22.export import ADAPTER_NAME, lora_layers


def test_b_matrices_get_their_own_group_per_expert_at_the_ratio():
    adapter = make_adapter("tiny-t2v", lr=1e-4, lora={"plus_lr_ratio": 16.0}, lr_low_noise=3e-5)
    groups = adapter.param_groups()
    assert [(g["name"], g["lr"]) for g in groups] == [
        ("high_noise", 1e-4), ("high_noise_B", 1e-4 * 16), ("low_noise", 3e-5), ("low_noise_B", 3e-5 * 16)]
    for expert, a_group, b_group in (("high_noise", groups[0], groups[1]), ("low_noise", groups[2], groups[3])):
        bs = {id(layer.lora_B[ADAPTER_NAME].weight) for _, layer in lora_layers(adapter.transformer_for(expert))}
        assert {id(p) for p in b_group["params"]} == bs and not bs & {id(p) for p in a_group["params"]}
        assert len(a_group["params"]) + len(b_group["params"]) == len(adapter.trainable_parameters(expert))
        assert b_group["follows"] == a_group["name"] and b_group["lr_ratio"] == 16.0


def test_without_the_ratio_each_expert_has_one_group():
    assert [g["name"] for g in make_adapter("tiny-ti2v").param_groups()] == ["lora"]
    assert [g["name"] for g in make_adapter("tiny-ti2v", lora={"plus_lr_ratio": 4.0}).param_groups()] == [
        "lora", "lora_B"]
