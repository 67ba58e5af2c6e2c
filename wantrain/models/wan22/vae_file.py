"""The Wan 2.1 VAE from one file (``model.vae_file``): ComfyUI's ``wan_2.1_vae.safetensors`` or the original repos'
``Wan2.1_VAE.pth`` (a torch pickle, read only with ``weights_only=True``), in the original Wan key layout.

The original layout (Wan's ``wan/modules/vae2_1.py``) and diffusers' ``AutoencoderKLWan`` differ only in names
(facts, as diffusers' ``convert_wan_vae_to_diffusers`` maps them for the released model): ``conv1``/``conv2`` are
``quant_conv``/``post_quant_conv``; ``{encoder,decoder}.conv1`` is ``conv_in``; a residual block's
``residual.{0,2,3,6}`` are ``norm1.gamma``, ``conv1``, ``norm2.gamma``, ``conv2`` and its ``shortcut`` is
``conv_shortcut``; ``middle.{0,1,2}`` are ``mid_block.resnets.0``, ``mid_block.attentions.0``,
``mid_block.resnets.1``; ``head.{0,2}`` are ``norm_out`` and ``conv_out``; the encoder's flat ``downsamples.N`` are
``down_blocks.N``; the decoder's flat ``upsamples.N`` are grouped per level into ``up_blocks.L.resnets.J`` and
``up_blocks.L.upsamplers.0`` (a level ends at its upsampler). The grouping is read off the file, and the
architecture (base width, channel multipliers, residual blocks per level, which downsamples are temporal) off the
tensor shapes, so the same code reads the released VAE and the tiny twin. Latent normalisation is the Wan 2.1 one.

The Wan 2.2 VAE (TI2V-5B, 48 channels) has another block structure; its single file is refused in one line (load
it from a diffusers folder's ``vae/``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from wantrain.core.errors import UserError
from wantrain.models.wan22.text_file import read_shapes, read_state

_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias", "conv2.weight": "post_quant_conv.weight",
        "conv2.bias": "post_quant_conv.bias"}
_FLAT = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)$")


def _block_part(rest: str) -> str:
    return _RESIDUAL.get(rest, rest)  # a resample keeps its names (resample.1.*, time_conv.*)


def to_diffusers_keys(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``state`` (original Wan 2.1 VAE layout) under ``AutoencoderKLWan``'s names."""
    ups = sorted({int(m.group(2)) for k in state if (m := _FLAT.match(k)) and m.group(1) == "decoder.upsamples"})
    samplers = {int(m.group(2)) for k in state if (m := _FLAT.match(k)) and m.group(1) == "decoder.upsamples"
                and m.group(3).startswith(("resample.", "time_conv."))}
    place: dict[int, str] = {}
    level, j = 0, 0
    for n in ups:
        if n in samplers:
            place[n] = f"decoder.up_blocks.{level}.upsamplers.0"
            level, j = level + 1, 0
        else:
            place[n] = f"decoder.up_blocks.{level}.resnets.{j}"
            j += 1
    out = {}
    for key, value in state.items():
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        flat = _FLAT.match(key)
        if flat is not None:
            kind, n, rest = flat.group(1), int(flat.group(2)), flat.group(3)
            base = f"encoder.down_blocks.{n}" if kind == "encoder.downsamples" else place[n]
            out[f"{base}.{_block_part(rest)}"] = value
            continue
        side, _, rest = key.partition(".")
        if side not in ("encoder", "decoder"):
            raise UserError(f"model.vae_file '{path}': key {key!r} is not part of the Wan 2.1 VAE")
        if rest.startswith("conv1."):
            new = "conv_in." + rest.removeprefix("conv1.")
        elif rest.startswith("middle.1."):
            new = "mid_block.attentions.0." + rest.removeprefix("middle.1.")
        elif m := re.match(r"^middle\.([02])\.(.+)$", rest):
            new = f"mid_block.resnets.{int(m.group(1)) // 2}.{_block_part(m.group(2))}"
        elif rest.startswith("head.0."):
            new = "norm_out." + rest.removeprefix("head.0.")
        elif rest.startswith("head.2."):
            new = "conv_out." + rest.removeprefix("head.2.")
        else:
            raise UserError(f"model.vae_file '{path}': key {key!r} is not part of the Wan 2.1 VAE")
        out[f"{side}.{new}"] = value
    return out


def vae_config(state: dict[str, tuple[int, ...]], path: Path) -> dict:
    """``AutoencoderKLWan`` arguments read off the shapes (``state``: name -> shape) of an original-layout VAE."""
    from wantrain.models.wan22.architecture import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD

    try:
        base = state["encoder.conv1.weight"][0]
        z_dim = state["conv2.weight"][0]
        downs = sorted({int(m.group(2)) for k in state if (m := _FLAT.match(k)) and m.group(1) ==
                        "encoder.downsamples"})
        resample = [n for n in downs if f"encoder.downsamples.{n}.resample.1.weight" in state]
        per_level = resample[0] if resample else len(downs)
        widths = []
        for n in downs:
            if n not in resample:
                widths.append(state[f"encoder.downsamples.{n}.residual.2.weight"][0] // base)
        mult = widths[::per_level]
        temporal = [f"encoder.downsamples.{n}.time_conv.weight" in state for n in resample]
    except (KeyError, IndexError, ZeroDivisionError) as exc:
        raise UserError(f"model.vae_file '{path}' is missing Wan VAE tensors ({exc})") from None
    return dict(base_dim=base, z_dim=z_dim, dim_mult=mult, num_res_blocks=per_level, attn_scales=[],
                temperal_downsample=temporal, latents_mean=list(WAN21_LATENTS_MEAN),
                latents_std=list(WAN21_LATENTS_STD))


def check_vae_file(path: Path, *, latent_channels: int) -> dict:
    """The ``AutoencoderKLWan`` arguments of the file's VAE, from its header; refuses (one line) a Wan 2.2 VAE, a
    file that is not a Wan VAE in the original layout, and a VAE of another latent width."""
    shapes = {k.removeprefix("vae."): v for k, v in read_shapes(path, "vae_file").items()}
    return _checked_config(shapes, path, latent_channels)


def _checked_config(shapes: dict[str, tuple[int, ...]], path: Path, latent_channels: int) -> dict:
    conv = shapes.get("encoder.conv1.weight")
    if any("avg_shortcut" in k for k in shapes) or (conv is not None and len(conv) > 1 and conv[1] == 12):
        raise UserError(f"model.vae_file '{path}' is a Wan 2.2 VAE (48 channels, TI2V-5B); its single file is not "
                        "read yet: load it from a diffusers folder (model.path with vae/)")
    if "decoder.middle.0.residual.0.gamma" not in shapes:
        example = next(iter(shapes), "nothing")
        raise UserError(f"model.vae_file '{path}' is not a Wan VAE in the original layout (first key {example!r})")
    config = vae_config(shapes, path)
    if config["z_dim"] != latent_channels:
        raise UserError(f"model.vae_file '{path}' has {config['z_dim']} latent channels; this variant's VAE has "
                        f"{latent_channels}")
    return config


def load_vae(path: Path, *, latent_channels: int):
    """An ``AutoencoderKLWan`` (float32, eval mode) with the weights of ``path``; refuses a file of another VAE."""
    from diffusers import AutoencoderKLWan

    path = Path(path).expanduser()
    state = {k.removeprefix("vae."): v for k, v in read_state(path, "vae_file").items()}  # some repackagings prefix
    config = _checked_config({k: tuple(v.shape) for k, v in state.items()}, path, latent_channels)
    with torch.device("meta"):
        vae = AutoencoderKLWan(**config)
    converted = {k: v.float() for k, v in to_diffusers_keys(state, path).items()}
    missing, unexpected = vae.load_state_dict(converted, strict=False, assign=True)
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise UserError(f"model.vae_file '{path}' does not fit a Wan 2.1 VAE of its own shapes ({what}; "
                        f"{len(missing)} missing, {len(unexpected)} unexpected)")
    return vae.eval()
