"""Loading: diffusers-format directories, single-file (ComfyUI-keyed) checkpoints, and one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from wan22_helpers import make_adapter, to_comfyui_keys

from wantrain.core.errors import UserError


def _base_state(transformer):
    return {k.replace("base_layer.", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k}


def _link_dir(src, dst, skip=()):
    dst.mkdir()
    for entry in os.listdir(src):
        if entry not in skip:
            os.symlink(src / entry, dst / entry)
    return dst


def test_adapter_loads_the_weights_of_a_diffusers_directory(tiny_dir):
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    adapter = make_adapter("tiny-t2v", path=str(path))
    for expert, folder in (("high_noise", "transformer"), ("low_noise", "transformer_2")):
        saved = WanTransformer3DModel.from_pretrained(str(path), subfolder=folder).state_dict()
        loaded = _base_state(adapter.transformer_for(expert))
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert str(path.resolve()) in adapter.encoder_identity


def test_directory_without_transformer_2_fails_in_one_line_when_both_experts_train(tiny_dir, tmp_path):
    partial = _link_dir(tiny_dir("tiny-t2v"), tmp_path / "partial", skip=("transformer_2",))
    with pytest.raises(UserError) as err:
        make_adapter("tiny-t2v", path=str(partial), experts="both")
    message = str(err.value)
    assert "missing transformer_2/" in message and "low-noise expert" in message and "'both'" in message
    assert "\n" not in message
    # Training only the high-noise expert does not need it.
    assert make_adapter("tiny-t2v", path=str(partial), experts="high_noise").experts == ("high_noise",)


@pytest.mark.parametrize("missing", ["vae", "text_encoder", "tokenizer"])
def test_directory_without_an_encoder_part_names_it(tiny_dir, tmp_path, missing):
    partial = _link_dir(tiny_dir("tiny-t2v"), tmp_path / "partial", skip=(missing,))
    with pytest.raises(UserError, match=f"{missing}/"):
        make_adapter("tiny-t2v", path=str(partial))


def test_directory_of_another_variant_is_rejected_by_its_channels(tiny_dir):
    with pytest.raises(UserError, match=r"does not match tiny-i2v: in_channels = 16 \(needs 36\)"):
        make_adapter("tiny-i2v", path=str(tiny_dir("tiny-t2v")))
    with pytest.raises(UserError, match="is not a directory"):
        make_adapter("tiny-t2v", path="/nonexistent/wan")


def test_wan21_image_to_video_folder_is_not_taken_for_i2v_a14b(tiny_dir, tmp_path):
    """Wan 2.1 I2V-14B has I2V-A14B's 36 input channels but a CLIP image branch (image_dim, added_kv_proj_dim)."""
    wan21 = _link_dir(tiny_dir("tiny-i2v"), tmp_path / "wan21", skip=("transformer",))
    (wan21 / "transformer").mkdir()
    config = json.loads((tiny_dir("tiny-i2v") / "transformer" / "config.json").read_text())
    (wan21 / "transformer" / "config.json").write_text(json.dumps({**config, "image_dim": 4, "added_kv_proj_dim": 24}))
    with pytest.raises(UserError) as err:
        make_adapter("tiny-i2v", path=str(wan21), experts="high_noise")
    message = str(err.value)
    assert "transformer/config.json does not match tiny-i2v" in message and "Wan 2.1" in message
    assert "image_dim = 4 (needs None)" in message and "added_kv_proj_dim = 24 (needs None)" in message
    assert "\n" not in message


def test_single_file_comfyui_checkpoint_loads_with_the_variants_explicit_config(tiny_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-i2v")  # 36 input channels: diffusers' Wan 2.1 auto-detection would get it wrong
    original = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()
    single = tmp_path / "wan2.2_i2v_low_noise_tiny.safetensors"
    save_file(to_comfyui_keys(original), str(single))
    partial = _link_dir(path, tmp_path / "no_transformer_2", skip=("transformer_2",))
    adapter = make_adapter("tiny-i2v", path=str(partial), low_noise_file=str(single))
    loaded = _base_state(adapter.transformer_for("low_noise"))
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) for k in original)


def test_single_file_of_the_wrong_model_is_a_one_line_error(tiny_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    t2v = WanTransformer3DModel.from_pretrained(str(tiny_dir("tiny-t2v")), subfolder="transformer").state_dict()
    single = tmp_path / "t2v_high.safetensors"
    save_file(to_comfyui_keys(t2v), str(single))
    with pytest.raises(UserError, match="high_noise_file .* does not fit the tiny-i2v transformer") as err:
        make_adapter("tiny-i2v", path=str(tiny_dir("tiny-i2v")), high_noise_file=str(single), experts="high_noise")
    assert "\n" not in str(err.value)


def test_single_file_with_a_wan21_image_branch_is_refused(tiny_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    i2v = WanTransformer3DModel.from_pretrained(str(tiny_dir("tiny-i2v")), subfolder="transformer").state_dict()
    wan21 = {**to_comfyui_keys(i2v), "model.diffusion_model.img_emb.proj.1.weight": torch.zeros(24, 4),
             "model.diffusion_model.blocks.0.cross_attn.k_img.weight": torch.zeros(24, 24)}
    single = tmp_path / "wan2.1_i2v_480p_tiny.safetensors"
    save_file(wan21, str(single))
    with pytest.raises(UserError, match=r"high_noise_file .* holds a Wan 2\.1 CLIP image branch") as err:
        make_adapter("tiny-i2v", path=str(tiny_dir("tiny-i2v")), high_noise_file=str(single), experts="high_noise")
    assert "\n" not in str(err.value)


def test_tiny_encoder_identity_depends_on_seed_and_variant_only():
    a = make_adapter("tiny-t2v", seed=1).encoder_identity
    assert a == make_adapter("tiny-t2v", seed=1, experts="low_noise").encoder_identity
    assert a != make_adapter("tiny-t2v", seed=2).encoder_identity
    assert a != make_adapter("tiny-i2v", seed=1).encoder_identity


def test_encoders_load_lazily_and_are_released():
    adapter = make_adapter("tiny-t2v")
    assert not adapter.encoders_loaded
    adapter.encode_text(["a cat"])
    assert adapter.encoders_loaded
    adapter.release_encoders()
    assert not adapter.encoders_loaded


def test_the_sampling_only_expert_comes_from_the_same_kinds_of_source_and_a_missing_one_is_one_line(tiny_dir,
                                                                                                     tmp_path):
    """experts = "low_noise" with [sample]: the high-noise expert is read from its folder, from
    model.high_noise_file, or refused in one line naming what is missing (folder, file, or a partial folder of
    shards)."""
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    original = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer").state_dict()
    single = tmp_path / "wan2.2_t2v_high_noise_tiny.safetensors"
    save_file(to_comfyui_keys(original), str(single))
    partial = _link_dir(path, tmp_path / "no_transformer", skip=("transformer",))
    for source in ({"path": str(path)}, {"path": str(partial), "high_noise_file": str(single)}):
        adapter = make_adapter("tiny-t2v", experts="low_noise", **source)
        assert adapter.add_sampling_expert() == "high_noise"
        loaded = adapter.transformer_for("high_noise").state_dict()
        assert all(torch.equal(loaded[k], original[k]) for k in original), source
    empty = tmp_path / "high_noise_model"
    empty.mkdir()
    for source, refusal in (
            ({"path": str(partial)}, r"missing transformer/ \(the high-noise expert, needed to sample with one "
                                     r"trained expert; or set model.high_noise_file\)"),
            ({"path": str(partial), "high_noise_file": str(tmp_path / "gone.safetensors")},
             "model.high_noise_file .*gone.safetensors' does not exist"),
            ({"path": str(partial), "high_noise_file": str(empty)},
             "model.high_noise_file .* is a folder without a .*index.json and with 0 .safetensors files")):
        adapter = make_adapter("tiny-t2v", experts="low_noise", **source)
        with pytest.raises(UserError, match=refusal) as err:
            adapter.add_sampling_expert()
        assert "\n" not in str(err.value)
