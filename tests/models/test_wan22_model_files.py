"""The model files users already have: the Wan 2.1 VAE and UMT5 as single files (tiny twins written in the original
and ComfyUI key layouts) give the latents and embeddings of the diffusers folder; an expert as the original repos'
folder of shards with an index loads like its diffusers folder; a tokenizer from a local folder; one-line refusals
of wrong and partial files; `wantrain check` names what it loads from where."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from wan22_helpers import make_adapter, raw_batch, to_comfyui_keys

from wantrain.core.errors import UserError
from wantrain.models.wan22.vae_file import check_vae_file, to_diffusers_keys, vae_config

_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
             "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
             "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def vae_to_original(state):
    """A diffusers ``AutoencoderKLWan`` state dict in the original Wan 2.1 layout (written independently of the
    loader's mapping: the decoder's flat index counts each level's resnets, then its upsampler)."""
    levels: dict[int, set[str]] = {}
    for k in state:
        m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets\.\d+|upsamplers\.0)\.", k)
        if m:
            levels.setdefault(int(m.group(1)), set()).add(m.group(2))
    flat, n = {}, 0
    for level in sorted(levels):
        for r in sorted((x for x in levels[level] if x.startswith("resnets")), key=lambda x: int(x.split(".")[1])):
            flat[f"up_blocks.{level}.{r}"], n = n, n + 1
        if "upsamplers.0" in levels[level]:
            flat[f"up_blocks.{level}.upsamplers.0"], n = n, n + 1
    out = {}
    for k, t in state.items():
        if k.startswith(("quant_conv.", "post_quant_conv.")):
            out[("conv1." if k.startswith("quant") else "conv2.") + k.split(".", 1)[1]] = t
            continue
        side, rest = k.split(".", 1)
        for prefix, new in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2."),
                            ("mid_block.attentions.0.", "middle.1.")):
            if rest.startswith(prefix):
                out[f"{side}.{new}{rest[len(prefix):]}"] = t
                break
        else:
            if m := re.match(r"mid_block\.resnets\.(\d)\.(.+)", rest):
                out[f"{side}.middle.{2 * int(m.group(1))}.{_RESIDUAL.get(m.group(2), m.group(2))}"] = t
            elif m := re.match(r"down_blocks\.(\d+)\.(.+)", rest):
                out[f"{side}.downsamples.{m.group(1)}.{_RESIDUAL.get(m.group(2), m.group(2))}"] = t
            elif m := re.match(r"(up_blocks\.\d+\.(?:resnets\.\d+|upsamplers\.0))\.(.+)", rest):
                out[f"decoder.upsamples.{flat[m.group(1)]}.{_RESIDUAL.get(m.group(2), m.group(2))}"] = t
            else:
                raise AssertionError(k)
    return {k: v.contiguous() for k, v in out.items()}


_T5 = [(r"^shared\.weight$", "token_embedding.weight"), (r"^encoder\.final_layer_norm\.weight$", "norm.weight"),
       (r"layer\.0\.layer_norm", "norm1"),
       (r"layer\.0\.SelfAttention\.relative_attention_bias", "pos_embedding.embedding"),
       (r"layer\.0\.SelfAttention\.", "attn."), (r"layer\.1\.layer_norm", "norm2"),
       (r"layer\.1\.DenseReluDense\.wi_0", "ffn.gate.0"), (r"layer\.1\.DenseReluDense\.wi_1", "ffn.fc1"),
       (r"layer\.1\.DenseReluDense\.wo", "ffn.fc2"), (r"^encoder\.block\.", "blocks.")]


def t5_to_wan(state):
    """A ``UMT5EncoderModel`` state dict under the original Wan T5 names (``models_t5_umt5-xxl-enc-bf16.pth``)."""
    out = {}
    for k, v in state.items():
        if k == "encoder.embed_tokens.weight":
            continue
        for pattern, new in _T5:
            k = re.sub(pattern, new, k)
        out[k] = v.clone()
    return out


def encoder_parts(tiny_dir, variant="tiny-t2v"):
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    path = tiny_dir(variant)
    vae = AutoencoderKLWan.from_pretrained(str(path), subfolder="vae")
    text = UMT5EncoderModel.from_pretrained(str(path), subfolder="text_encoder")
    return path, vae, text


def without(path, tmp_path, *parts):
    """A copy of the diffusers folder (symlinks) that lacks ``parts``."""
    partial = tmp_path / ("without_" + "_".join(parts))
    partial.mkdir()
    for entry in os.listdir(path):
        if entry not in parts:
            os.symlink(path / entry, partial / entry)
    return partial


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_the_vae_from_one_file_gives_the_folders_latents(tiny_dir, tmp_path, suffix):
    path, vae, _ = encoder_parts(tiny_dir)
    original = vae_to_original(vae.state_dict())
    file = tmp_path / f"wan_2.1_vae{suffix}"
    save_file(original, file) if suffix == ".safetensors" else torch.save(original, file)
    folder = make_adapter("tiny-t2v", path=str(path), experts="high_noise")
    single = make_adapter("tiny-t2v", path=str(without(path, tmp_path, "vae")), vae_file=str(file),
                          experts="high_noise")
    pixels = raw_batch(batch_size=2, frames=9, size=32)["pixels"]
    assert torch.equal(folder.encode_media(pixels)["latents"], single.encode_media(pixels)["latents"])
    assert single.encoder_identity != folder.encoder_identity  # the cache keys on the file


def test_the_vae_mapping_is_diffusers_own_on_the_released_architecture():
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    with torch.device("meta"):
        released = AutoencoderKLWan()  # diffusers' defaults are the Wan 2.1 VAE
    original = vae_to_original(released.state_dict())
    assert set(convert_wan_vae_to_diffusers(dict(original))) == set(released.state_dict())  # the test's inverse
    assert set(to_diffusers_keys(original, "x")) == set(released.state_dict())  # wantrain's mapping
    config = vae_config({k: tuple(v.shape) for k, v in original.items()}, "x")
    assert (config["base_dim"], config["dim_mult"], config["num_res_blocks"], config["temperal_downsample"]) == (
        96, [1, 2, 4, 4], 2, [False, True, True])


@pytest.mark.parametrize("layout", ["comfyui", "wan_pth"])
def test_umt5_from_one_file_gives_the_folders_embeddings(tiny_dir, tmp_path, layout):
    path, _, text = encoder_parts(tiny_dir)
    if layout == "comfyui":
        file = tmp_path / "umt5_xxl_fp16.safetensors"
        save_file({k: v.contiguous() for k, v in text.state_dict().items() if k != "encoder.embed_tokens.weight"},
                  file)
    else:
        file = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
        torch.save(t5_to_wan(text.state_dict()), file)
    folder = make_adapter("tiny-t2v", path=str(path), experts="high_noise")
    single = make_adapter("tiny-t2v", path=str(without(path, tmp_path, "text_encoder")),
                          text_encoder_file=str(file), experts="high_noise")
    captions = ["a red ball bouncing on the grass", "a dog"]
    assert torch.equal(folder.encode_text(captions)["text_embeds"], single.encode_text(captions)["text_embeds"])


def write_shards(state, folder, parts=2):
    """``state`` in original Wan names as a folder of ``parts`` shards with an index, as the original repos ship
    ``high_noise_model/``."""
    folder.mkdir(parents=True)
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        shard = f"diffusion_pytorch_model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({k.removeprefix("model.diffusion_model."): state[k] for k in chunk}, folder / shard)
        weight_map.update({k.removeprefix("model.diffusion_model."): shard for k in chunk})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_a_sharded_original_layout_expert_loads_like_its_folder(tiny_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    state = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()
    shards = write_shards(to_comfyui_keys(state), tmp_path / "low_noise_model")
    folder = make_adapter("tiny-t2v", path=str(path), experts="low_noise")
    sharded = make_adapter("tiny-t2v", path=str(without(path, tmp_path, "transformer_2")),
                           low_noise_file=str(shards), experts="low_noise")
    a = folder.transformer_for("low_noise").state_dict()
    b = sharded.transformer_for("low_noise").state_dict()
    base = [k for k in a if ".lora_" not in k]  # the LoRA's A starts random per adapter
    assert a.keys() == b.keys() and len(base) > 50 and all(torch.equal(a[k], b[k]) for k in base)
    (shards / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"model.low_noise_file '.*low_noise_model' is incomplete: 1 of 2 shards .* "
                                        r"missing, first diffusion_pytorch_model-00002-of-00002.safetensors"):
        make_adapter("tiny-t2v", path=str(path), low_noise_file=str(shards), experts="low_noise")


def test_every_part_from_files_and_a_tokenizer_folder_needs_no_model_path(tiny_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    path, vae, text = encoder_parts(tiny_dir)
    vae_file = tmp_path / "vae.safetensors"
    save_file(vae_to_original(vae.state_dict()), vae_file)
    text_file = tmp_path / "umt5.pth"
    torch.save(t5_to_wan(text.state_dict()), text_file)
    high = tmp_path / "high.safetensors"
    save_file(to_comfyui_keys(WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer").state_dict()),
              high)
    files = make_adapter("tiny-t2v", high_noise_file=str(high), experts="high_noise", vae_file=str(vae_file),
                         text_encoder_file=str(text_file), tokenizer_path=str(path / "tokenizer"))
    folder = make_adapter("tiny-t2v", path=str(path), experts="high_noise")
    batch = raw_batch(batch_size=1)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(files.loss(batch, "high_noise", g1), folder.loss(batch, "high_noise", g2))


def test_wrong_and_partial_encoder_files_are_refused_in_one_line(tiny_dir, tmp_path):
    path, vae, text = encoder_parts(tiny_dir)
    text_file = tmp_path / "umt5.safetensors"
    save_file({k: v.contiguous() for k, v in text.state_dict().items() if k != "encoder.embed_tokens.weight"},
              text_file)
    with pytest.raises(UserError, match="model.vae_file '.*umt5.safetensors' is not a Wan VAE in the original layout"):
        make_adapter("tiny-t2v", path=str(path), vae_file=str(text_file), experts="high_noise")
    vae_file = tmp_path / "vae.safetensors"
    save_file(vae_to_original(vae.state_dict()), vae_file)
    with pytest.raises(UserError, match="model.text_encoder_file '.*vae.safetensors' is not a UMT5 encoder"):
        make_adapter("tiny-t2v", path=str(path), text_encoder_file=str(vae_file), experts="high_noise")
    with pytest.raises(UserError, match="is a Wan 2.1 VAE .16 latent channels.*this variant needs a Wan 2.2 VAE"):
        check_vae_file(vae_file, latent_channels=48)
    pickle_file = tmp_path / "code.pth"
    torch.save({"x": object()}, pickle_file)  # a pickle that weights_only=True refuses to run
    with pytest.raises(UserError, match="model.vae_file '.*code.pth' is not a readable weights file"):
        make_adapter("tiny-t2v", path=str(path), vae_file=str(pickle_file), experts="high_noise")
    with pytest.raises(UserError, match="model.tokenizer_path '.*' is not a folder with tokenizer files"):
        make_adapter("tiny-t2v", path=str(path), tokenizer_path=str(tmp_path), experts="high_noise")


def vae_file_and_data(tiny_dir, tmp_path):
    """The tiny model folder, its VAE as one original-layout file and a one-image dataset in ``tmp_path/data``."""
    from PIL import Image

    from wantrain.data.demo import render

    path, vae, _ = encoder_parts(tiny_dir)
    vae_file = tmp_path / "vae.safetensors"
    save_file(vae_to_original(vae.state_dict()), vae_file)
    (tmp_path / "data").mkdir()
    Image.fromarray(render("square", (50, 90, 240), (0, 0, 0), "right", 32, 32, 1)[0]).save(tmp_path / "data/a.png")
    (tmp_path / "data" / "a.txt").write_text("a blue square")
    return path, vae_file


def test_check_names_what_the_run_loads_from_where(tiny_dir, tmp_path, capsys):
    from wantrain.cli.main import main

    path, vae_file = vae_file_and_data(tiny_dir, tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\nvariant = "tiny-t2v"\npath = "{path}"\nvae_file = "{vae_file}"\n'
                      f'[data]\npath = "data"\n')
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"  high-noise expert: {path / 'transformer'}/ (diffusers folder)" in out
    assert f"  VAE: {vae_file} (model.vae_file)" in out and f"  tokenizer: {path / 'tokenizer'}/" in out


def test_check_refuses_a_vae_given_as_an_expert_file_as_run_does(tiny_dir, tmp_path, capsys):
    from wantrain.cli.main import main

    path, vae_file = vae_file_and_data(tiny_dir, tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(f'[run]\noutput_dir = "runs"\n[model]\nvariant = "tiny-t2v"\npath = "{path}"\n'
                      f'high_noise_file = "{vae_file}"\nexperts = "high_noise"\n[data]\npath = "data"\n')
    line = (f"model.high_noise_file '{vae_file}' does not fit the tiny-t2v transformer: "
            "69 tensors of the model are not in the file")
    for command in ("check", "run"):
        assert main([command, str(config)]) == 2
        err = capsys.readouterr().err
        assert line in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
