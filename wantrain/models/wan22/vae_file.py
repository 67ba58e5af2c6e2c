"""The Wan VAEs from one file (``model.vae_file``), in the original Wan key layout: the Wan 2.1 VAE (ComfyUI's
``wan_2.1_vae.safetensors``, the original repos' ``Wan2.1_VAE.pth``; 16 latent channels, the A14B models) and the
Wan 2.2 VAE (``wan2.2_vae.safetensors``, ``Wan2.2_VAE.pth``; 48 channels, TI2V-5B). ``.pth`` files are torch
pickles, read only with ``weights_only=True``.

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

The Wan 2.2 VAE (``AutoencoderKLWan(is_residual=True)``) nests its levels instead (facts, as diffusers'
``convert_vae_22`` in ``scripts/convert_wan_to_diffusers.py`` maps the released file): the encoder's
``downsamples.L.downsamples.J`` are ``down_blocks.L.resnets.J`` (a residual block, same inner names as above) or
``down_blocks.L.downsampler`` (the level's resample and ``time_conv``), the decoder's ``upsamples.L.upsamples.J``
likewise ``up_blocks.L.resnets.J`` / ``up_blocks.L.upsampler``; the parameter-free average and duplicate shortcuts
have no tensors. Its input is patchified (``in_channels`` = 3 x patch^2: 12 for the released patch 2), the decoder
has a base width of its own (256 against the encoder's 160), all read off the shapes, and its latent normalisation
is the Wan 2.2 one (48 channels). A file of the other VAE than the variant's is refused in one line.
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
_NESTED = re.compile(r"^(encoder|decoder)\.(?:downsamples|upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)$")

# Wan 2.2 VAE latent normalisation (48 channels), as the released TI2V-5B VAE's config gives it.
WAN22_LATENTS_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                      0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                      -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                      -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                      0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                     0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                     0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                     0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
# AutoencoderKLWan arguments of the released VAEs (diffusers' defaults are the Wan 2.1 VAE; the TI2V-5B VAE as in
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json), for counting their bytes on meta (models/wan22/memory.py)
RELEASED_VAE = {"wan2.1": {}, "wan2.2": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                                             num_res_blocks=2, temperal_downsample=[False, True, True],
                                             is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                             scale_factor_spatial=16, scale_factor_temporal=4)}
_NAME = {16: "a Wan 2.1 VAE (16 latent channels: wan_2.1_vae.safetensors, for the A14B models)",
         48: "a Wan 2.2 VAE (48 latent channels: wan2.2_vae.safetensors, for TI2V-5B)"}


def is_wan22_layout(keys) -> bool:
    """The file nests its levels (``encoder.downsamples.L.downsamples.J.``): the Wan 2.2 VAE."""
    return any(_NESTED.match(k) for k in keys)


def _block_part(rest: str) -> str:
    return _RESIDUAL.get(rest, rest)  # a resample keeps its names (resample.1.*, time_conv.*)


def to_diffusers_keys(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``state`` (original Wan 2.1 or 2.2 VAE layout) under ``AutoencoderKLWan``'s names."""
    if is_wan22_layout(state):
        return _wan22_to_diffusers_keys(state, path)
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
        out[_outer_key(key, path, "Wan 2.1")] = value
    return out


def _wan22_to_diffusers_keys(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        nested = _NESTED.match(key)
        if nested is not None:
            side, level, j, rest = nested.groups()
            blocks, sampler = ("down_blocks", "downsampler") if side == "encoder" else ("up_blocks", "upsampler")
            if rest.startswith(("resample.", "time_conv.")):
                out[f"{side}.{blocks}.{level}.{sampler}.{rest}"] = value
            else:
                out[f"{side}.{blocks}.{level}.resnets.{j}.{_block_part(rest)}"] = value
            continue
        out[_outer_key(key, path, "Wan 2.2")] = value
    return out


def _outer_key(key: str, path: Path, which: str) -> str:
    """The diffusers name of a key outside the levels (input conv, middle, head), the same in both VAEs."""
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        raise UserError(f"model.vae_file '{path}': key {key!r} is not part of the {which} VAE")
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
        raise UserError(f"model.vae_file '{path}': key {key!r} is not part of the {which} VAE")
    return f"{side}.{new}"


def vae_config(state: dict[str, tuple[int, ...]], path: Path) -> dict:
    """``AutoencoderKLWan`` arguments read off the shapes (``state``: name -> shape) of an original-layout VAE."""
    from wantrain.models.wan22.architecture import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD

    if is_wan22_layout(state):
        return _wan22_config(state, path)
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


def _wan22_config(state: dict[str, tuple[int, ...]], path: Path) -> dict:
    """The residual (Wan 2.2) VAE's arguments: widths from each level's first residual block, the patch from the
    input channels (3 x patch^2), the decoder's own base width from its input conv."""
    levels: dict[int, set[int]] = {}
    for key in state:
        if (m := _NESTED.match(key)) and m.group(1) == "encoder" and m.group(4).startswith("residual."):
            levels.setdefault(int(m.group(2)), set()).add(int(m.group(3)))
    try:
        base, in_channels = state["encoder.conv1.weight"][:2]
        z_dim = state["conv2.weight"][0]
        order = sorted(levels)
        mult = [state[f"encoder.downsamples.{n}.downsamples.0.residual.2.weight"][0] // base for n in order]
        temporal = [any(k.startswith(f"encoder.downsamples.{n}.downsamples.") and ".time_conv." in k for k in state)
                    for n in order[:-1]]
        decoder_base = state["decoder.conv1.weight"][0] // mult[-1]
        out_channels = state["decoder.head.2.weight"][0]
        patch = round((in_channels / 3) ** 0.5)
    except (KeyError, IndexError, ValueError, ZeroDivisionError) as exc:
        raise UserError(f"model.vae_file '{path}' is missing Wan 2.2 VAE tensors ({exc})") from None
    return dict(base_dim=base, decoder_base_dim=None if decoder_base == base else decoder_base, z_dim=z_dim,
                dim_mult=mult, num_res_blocks=len(levels[order[0]]), attn_scales=[], temperal_downsample=temporal,
                is_residual=True, in_channels=in_channels, out_channels=out_channels, patch_size=patch,
                scale_factor_spatial=patch * 2 ** len(temporal), scale_factor_temporal=2 ** sum(temporal),
                latents_mean=list(WAN22_LATENTS_MEAN), latents_std=list(WAN22_LATENTS_STD))


def check_vae_file(path: Path, *, latent_channels: int) -> dict:
    """The ``AutoencoderKLWan`` arguments of the file's VAE, from its header; refuses (one line) a file that is not
    a Wan VAE in the original layout, and the other Wan VAE than the variant's (by latent width)."""
    shapes = {k.removeprefix("vae."): v for k, v in read_shapes(path, "vae_file").items()}
    return _checked_config(shapes, path, latent_channels)


def _checked_config(shapes: dict[str, tuple[int, ...]], path: Path, latent_channels: int) -> dict:
    if "decoder.middle.0.residual.0.gamma" not in shapes or "conv2.weight" not in shapes:
        example = next(iter(shapes), "nothing")
        raise UserError(f"model.vae_file '{path}' is not a Wan VAE in the original layout (first key {example!r})")
    z_dim = shapes["conv2.weight"][0]
    if z_dim != latent_channels:
        have = _NAME.get(z_dim, f"a VAE with {z_dim} latent channels")
        want = _NAME.get(latent_channels, f"a VAE with {latent_channels} latent channels")
        raise UserError(f"model.vae_file '{path}' is {have}; this variant needs {want}")
    return vae_config(shapes, path)


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
        which = "Wan 2.2" if config.get("is_residual") else "Wan 2.1"
        raise UserError(f"model.vae_file '{path}' does not fit a {which} VAE of its own shapes ({what}; "
                        f"{len(missing)} missing, {len(unexpected)} unexpected)")
    return vae.eval()
