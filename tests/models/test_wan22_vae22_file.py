"""The Wan 2.2 VAE (TI2V-5B, 48 channels) from one file in the original / ComfyUI key layout
(``wan2.2_vae.safetensors``, ``Wan2.2_VAE.pth``): a tiny twin written in that layout gives the latents of the
diffusers folder bit for bit; the mapping covers the released architecture; the other Wan VAE than the variant's is
refused in one line."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import save_file
from test_wan22_model_files import _RESIDUAL, vae_to_original
from wan22_helpers import make_adapter, raw_batch

from wantrain.core.errors import UserError
from wantrain.models.wan22.vae_file import (
    RELEASED_VAE,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    to_diffusers_keys,
    vae_config,
)

RELEASED_5B_VAE = RELEASED_VAE["wan2.2"]  # Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json


def vae22_to_original(state):
    """A diffusers residual ``AutoencoderKLWan`` state dict in the original Wan 2.2 layout (written from the
    original module tree, independently of the loader: ``{encoder,decoder}.{down,up}samples.L.{down,up}samples.J``,
    the level's resample after its residual blocks)."""
    resnets: dict[tuple[str, int], int] = {}
    for k in state:
        if m := re.match(r"(encoder|decoder)\.(?:down|up)_blocks\.(\d+)\.resnets\.(\d+)\.", k):
            key = (m.group(1), int(m.group(2)))
            resnets[key] = max(resnets.get(key, 0), int(m.group(3)) + 1)
    out = {}
    for k, t in state.items():
        side, _, rest = k.partition(".")
        outer = "downsamples" if side == "encoder" else "upsamples"
        if m := re.match(r"(?:down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
            out[f"{side}.{outer}.{m.group(1)}.{outer}.{m.group(2)}.{_RESIDUAL[m.group(3)]}"] = t
        elif m := re.match(r"(?:down|up)_blocks\.(\d+)\.(?:downsampler|upsampler)\.(.+)", rest):
            level = int(m.group(1))
            out[f"{side}.{outer}.{level}.{outer}.{resnets[(side, level)]}.{m.group(2)}"] = t
        else:  # quant convs, input conv, middle and head: the Wan 2.1 names
            out.update(vae_to_original({k: t}))
    return {k: v.contiguous() for k, v in out.items()}


def _folder_with_released_normalisation(tiny_dir, tmp_path):
    """The tiny TI2V folder with its VAE's latent normalisation set to the released Wan 2.2 one (a single file
    carries none: the loader uses the released values), other parts linked."""
    from diffusers import AutoencoderKLWan

    path = tiny_dir("tiny-ti2v")
    folder = tmp_path / "ti2v_folder"
    folder.mkdir()
    for entry in os.listdir(path):
        if entry != "vae":
            os.symlink(path / entry, folder / entry)
    vae = AutoencoderKLWan.from_pretrained(str(path), subfolder="vae")
    vae.register_to_config(latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)
    vae.save_pretrained(str(folder / "vae"))
    without_vae = tmp_path / "ti2v_without_vae"
    without_vae.mkdir()
    for entry in os.listdir(path):
        if entry != "vae":
            os.symlink(path / entry, without_vae / entry)
    return folder, without_vae, vae


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_the_wan22_vae_from_one_file_gives_the_folders_latents(tiny_dir, tmp_path, suffix):
    folder, without_vae, vae = _folder_with_released_normalisation(tiny_dir, tmp_path)
    original = vae22_to_original(vae.state_dict())
    assert any(".downsamples.0.downsamples.0.residual." in k for k in original)
    file = tmp_path / f"wan2.2_vae{suffix}"
    save_file(original, file) if suffix == ".safetensors" else torch.save(original, file)
    from_folder = make_adapter("tiny-ti2v", path=str(folder))
    from_file = make_adapter("tiny-ti2v", path=str(without_vae), vae_file=str(file))
    pixels = raw_batch(batch_size=2, frames=9, size=32)["pixels"]
    a, b = from_folder.encode_media(pixels)["latents"], from_file.encode_media(pixels)["latents"]
    assert a.shape[1] == 48 and torch.equal(a, b)
    assert from_file.encoder_identity != from_folder.encoder_identity  # the cache keys on the file


def test_the_wan22_vae_mapping_covers_the_released_architecture():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        released = AutoencoderKLWan(**RELEASED_5B_VAE)
    original = vae22_to_original(released.state_dict())
    assert set(to_diffusers_keys(original, "x")) == set(released.state_dict())
    config = vae_config({k: tuple(v.shape) for k, v in original.items()}, "x")
    assert {k: config[k] for k in RELEASED_5B_VAE} == RELEASED_5B_VAE
    assert config["latents_mean"] == WAN22_LATENTS_MEAN and len(config["latents_std"]) == 48


def test_the_other_wan_vae_than_the_variants_is_refused_in_one_line(tiny_dir, tmp_path):
    from diffusers import AutoencoderKLWan

    t2v = tiny_dir("tiny-t2v")
    wan21 = tmp_path / "wan_2.1_vae.safetensors"
    save_file(vae_to_original(AutoencoderKLWan.from_pretrained(str(t2v), subfolder="vae").state_dict()), wan21)
    wan22 = tmp_path / "wan2.2_vae.safetensors"
    ti2v = tiny_dir("tiny-ti2v")
    save_file(vae22_to_original(AutoencoderKLWan.from_pretrained(str(ti2v), subfolder="vae").state_dict()), wan22)
    with pytest.raises(UserError, match=r"model\.vae_file '.*wan_2\.1_vae\.safetensors' is a Wan 2\.1 VAE \(16 "
                                        r"latent channels.*\); this variant needs a Wan 2\.2 VAE \(48") as err:
        make_adapter("tiny-ti2v", path=str(ti2v), vae_file=str(wan21))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"model\.vae_file '.*wan2\.2_vae\.safetensors' is a Wan 2\.2 VAE \(48 "
                                        r"latent channels.*\); this variant needs a Wan 2\.1 VAE \(16") as err:
        make_adapter("tiny-t2v", path=str(t2v), vae_file=str(wan22), experts="high_noise")
    assert "\n" not in str(err.value)
