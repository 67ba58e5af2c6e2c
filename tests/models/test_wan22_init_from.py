"""``lora.init_from``: start a LoRA from a file in wantrain's, ComfyUI's, diffusers' or musubi-tuner's key format,
per expert; rank and alpha from the file; one-line refusals of a wrong rank, a Wan 2.1 file and the other expert's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan22_helpers import make_adapter

from wantrain.core.errors import UserError
from wantrain.models.wan22.export import ADAPTER_NAME, lora_layers
from wantrain.models.wan22.lora_files import WAN_TO_DIFFUSERS


def random_lora(tmp_path, variant="tiny-t2v", rank=4, alpha=2.0, name="src", **model):
    """An exported wantrain LoRA with random A and B (B is zero at a fresh start, which would test nothing)."""
    adapter = make_adapter(variant, rank=rank, alpha=alpha, seed=3, **model)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.normal_()
    return adapter, adapter.saver(tmp_path, name).save(step=1, final=True)


def layers_of(adapter, expert):
    return {n: (layer.lora_A[ADAPTER_NAME].weight.detach().clone(), layer.lora_B[ADAPTER_NAME].weight.detach().clone(),
                layer.scaling[ADAPTER_NAME]) for n, layer in lora_layers(adapter.transformer_for(expert))}


def _wan_to_musubi(key):
    block, rest = key.removeprefix("diffusion_model.blocks.").split(".", 1)
    module, part = rest.rsplit(".", 2)[0], ".".join(rest.rsplit(".", 2)[1:])
    if rest.endswith(".alpha"):
        module, part = rest.removesuffix(".alpha"), "alpha"
    part = part.replace("lora_A.weight", "lora_down.weight").replace("lora_B.weight", "lora_up.weight")
    return f"lora_unet_blocks_{block}_{module.replace('.', '_')}.{part}"


def _wan_to_diffusers(key):
    block, rest = key.removeprefix("diffusion_model.blocks.").split(".", 1)
    for wan, diff in WAN_TO_DIFFUSERS.items():
        if rest.startswith(wan + "."):
            return f"transformer.blocks.{block}.{diff}{rest[len(wan):]}"
    raise AssertionError(key)


def write_format(src, dst, fmt):
    tensors = load_file(src)
    if fmt == "comfyui":  # original names with kohya's down/up
        out = {k.replace("lora_A", "lora_down").replace("lora_B", "lora_up"): v for k, v in tensors.items()}
        save_file(out, dst)
    elif fmt == "musubi":
        save_file({_wan_to_musubi(k): v for k, v in tensors.items()}, dst)
    elif fmt == "diffusers":  # no alpha tensors; peft's alpha in the metadata, as save_lora_weights writes it
        alpha = float(next(v for k, v in tensors.items() if k.endswith(".alpha")))
        out = {_wan_to_diffusers(k): v for k, v in tensors.items() if not k.endswith(".alpha")}
        save_file(out, dst, metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": alpha})})
    return dst


@pytest.mark.parametrize("fmt", ["wantrain", "comfyui", "musubi", "diffusers"])
def test_every_key_format_starts_the_expert_from_the_same_weights(tmp_path, fmt):
    source, files = random_lora(tmp_path)
    path = files[1] if fmt == "wantrain" else write_format(files[1], tmp_path / f"lora_{fmt}_low.safetensors", fmt)
    adapter = make_adapter("tiny-t2v", rank=None, experts="low_noise", lora={"init_from": path})
    assert (adapter.lora_config.rank, adapter.lora_config.alpha) == (4, 2.0)
    want, got = layers_of(source, "low_noise"), layers_of(adapter, "low_noise")
    assert want.keys() == got.keys() and len(got) == 20
    for name, (a, b, scale) in want.items():
        assert torch.equal(got[name][0], a.to(torch.bfloat16).float()), name
        assert torch.equal(got[name][1], b.to(torch.bfloat16).float()), name
        assert got[name][2] == scale == 0.5


def test_each_expert_starts_from_its_own_file_and_the_optimizer_starts_fresh(tmp_path):
    source, (high, low) = random_lora(tmp_path)
    adapter = make_adapter("tiny-t2v", rank=None, lora={"init_from_high_noise": high, "init_from_low_noise": low})
    for expert in ("high_noise", "low_noise"):
        want, got = layers_of(source, expert), layers_of(adapter, expert)
        assert all(torch.equal(got[n][1], b.to(torch.bfloat16).float()) for n, (_, b, _) in want.items())
    assert [g["name"] for g in adapter.param_groups()] == ["high_noise", "low_noise"]


def test_a_lora_rank_that_disagrees_with_the_file_is_refused_naming_both(tmp_path):
    _, (high, _) = random_lora(tmp_path)
    with pytest.raises(UserError, match=r"lora.rank = 8 disagrees with lora.init_from_high_noise '.*', a LoRA of "
                                        r"rank 4"):
        make_adapter("tiny-t2v", rank=8, lora={"init_from_high_noise": high})


def test_the_other_experts_file_is_refused_by_its_metadata_or_its_name(tmp_path):
    _, (high, low) = random_lora(tmp_path)
    with pytest.raises(UserError, match="is the low_noise expert's LoRA .*use lora.init_from_low_noise"):
        make_adapter("tiny-t2v", rank=None, lora={"init_from_high_noise": low})
    renamed = write_format(low, tmp_path / "my_low_noise.safetensors", "musubi")  # no metadata: the name decides
    with pytest.raises(UserError, match="its file name says"):
        make_adapter("tiny-t2v", rank=None, lora={"init_from_high_noise": renamed})


def test_a_wan21_image_to_video_lora_is_refused(tmp_path):
    _, (high, _) = random_lora(tmp_path, "tiny-i2v")
    tensors = load_file(high)
    tensors["diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight"] = torch.zeros(4, 24)
    tensors["diffusion_model.blocks.0.cross_attn.k_img.lora_B.weight"] = torch.zeros(24, 4)
    save_file(tensors, tmp_path / "wan21_i2v.safetensors")
    with pytest.raises(UserError, match="Wan 2.1 image-to-video LoRA .*k_img"):
        make_adapter("tiny-i2v", rank=None, experts="high_noise",
                     lora={"init_from": tmp_path / "wan21_i2v.safetensors"})


def test_a_lora_of_another_model_size_is_refused_naming_the_layer(tmp_path):
    _, (single,) = random_lora(tmp_path, "tiny-ti2v")
    tensors = {k: (torch.zeros(v.shape[0], 2 * v.shape[1]) if k.endswith("lora_A.weight") else v)
               for k, v in load_file(single).items()}  # as a wider model's LoRA would be
    save_file(tensors, tmp_path / "wide.safetensors")
    with pytest.raises(UserError, match=r"layer maps 24 -> 24 features; is this a LoRA for another model"):
        make_adapter("tiny-ti2v", rank=None, lora={"init_from": tmp_path / "wide.safetensors"})


def test_a_block_past_the_variants_count_and_unknown_modules_are_refused(tmp_path):
    _, (single,) = random_lora(tmp_path, "tiny-ti2v")
    tensors = load_file(single)
    extra = dict(tensors, **{"diffusion_model.blocks.7.ffn.0.lora_A.weight": torch.zeros(4, 24),
                             "diffusion_model.blocks.7.ffn.0.lora_B.weight": torch.zeros(32, 4)})
    save_file(extra, tmp_path / "deep.safetensors")
    with pytest.raises(UserError, match="names block 7, but tiny-ti2v has blocks 0..1"):
        make_adapter("tiny-ti2v", rank=None, lora={"init_from": tmp_path / "deep.safetensors"})
    head = dict(tensors, **{"diffusion_model.head.head.lora_A.weight": torch.zeros(4, 24)})
    save_file(head, tmp_path / "head.safetensors")
    with pytest.raises(UserError, match="key 'diffusion_model.head.head.lora_A.weight' is not a LoRA weight of a "
                                        "module wantrain trains"):
        make_adapter("tiny-ti2v", rank=None, lora={"init_from": tmp_path / "head.safetensors"})


def test_init_from_keys_that_do_not_suit_the_run_are_refused(tmp_path):
    _, (high, low) = random_lora(tmp_path)
    with pytest.raises(UserError, match="trains both experts of tiny-t2v; give lora.init_from_high_noise"):
        make_adapter("tiny-t2v", rank=None, lora={"init_from": high})
    with pytest.raises(UserError, match="does not train the low_noise expert"):
        make_adapter("tiny-t2v", rank=None, experts="high_noise", lora={"init_from_low_noise": low})
    with pytest.raises(UserError, match="does not exist"):
        make_adapter("tiny-t2v", rank=None, experts="high_noise", lora={"init_from": tmp_path / "nope.safetensors"})
