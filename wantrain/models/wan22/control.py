"""Control conditioning of the Wan 2.2 models: VACE's control context and first-last-frame I2V.

VACE (``vace-t2v-a14b``, ``WanVACETransformer3DModel``): every sample carries a control context of 96 channels
at the latent size, built as diffusers' ``WanVACEPipeline`` builds it (``prepare_video_latents`` /
``prepare_masks``): the normalized VAE latents of the control video where the mask is 0 (``inactive``, 16) and
where it is 1 (``reactive``, 16), then the pixel mask packed 8x8 into 64 channels and resampled to the latent
frames. With a reference image its latents (and 16 zero channels, and a zero mask) come first, one latent frame
more; the sample's target latents get the reference's latents in front as well, so the transformer sees the
layout the pipeline denoises, and the loss leaves that frame out (it is dropped after sampling).

First-last-frame (``model.condition = "first_last"`` on I2V-A14B): the condition latents encode ``[first frame,
zeros..., last frame]`` and the mask is 1 on the first and the last latent frame, as ``WanImageToVideoPipeline``
with ``last_image``.

:func:`problems` is the one place these features refuse a config.
"""

from __future__ import annotations

from typing import Any

import torch

CONTROL_ROLES = ("control", "mask", "reference")


def problems(model: Any) -> list[str]:
    """Every way ``model`` (a ``ModelConfig``) asks for a control feature its variant lacks: one line each, naming
    the key and what would be valid."""
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS[model.variant]
    out = []
    if model.condition == "first_last" and spec.conditioning != "i2v":
        out.append(f"model.condition = 'first_last' conditions I2V-A14B on a clip's first and last frames; "
                   f"{model.variant} is not an image-to-video variant (use i2v-a14b or tiny-i2v, or leave "
                   "model.condition at 'first_frame')")
    if model.vace_blocks != "lora" and not spec.vace:
        out.append(f"model.vace_blocks = {model.vace_blocks!r} applies to the VACE variants (vace-t2v-a14b, "
                   f"tiny-vace-t2v); {model.variant} has no VACE blocks: remove the key")
    return out


def pack_mask(mask: torch.Tensor, latent_frames: int, stride: int) -> torch.Tensor:
    """``mask`` [B, 1, F, H, W] in {0, 1} -> [B, stride*stride, latent_frames, H/stride, W/stride]: each
    ``stride`` x ``stride`` tile of pixels becomes channels (row offset major), the frames resampled by nearest
    neighbour (``nearest-exact``), as ``WanVACEPipeline.prepare_masks``."""
    b, _, f, h, w = mask.shape
    m = mask[:, 0].reshape(b, f, h // stride, stride, w // stride, stride)
    m = m.permute(0, 3, 5, 1, 2, 4).reshape(b, stride * stride, f, h // stride, w // stride)
    return torch.nn.functional.interpolate(m, size=(latent_frames, h // stride, w // stride), mode="nearest-exact")


def vace_context(encode, pixels: torch.Tensor, conditions: dict[str, torch.Tensor], stride: int
                 ) -> dict[str, torch.Tensor]:
    """The VACE sample of a batch: ``latents`` (with the reference's latent frame in front when there is one)
    and ``vace_context`` [B, 96, f(+1), h, w]; ``encode`` maps pixels [B, 3, F, H, W] to normalized latents.

    ``conditions``: ``control`` [B, 3, F, H, W] in [-1, 1] (the video VACE reads: pose, depth, edges...),
    ``mask`` [B, 1, F, H, W] in [0, 1] (1: generate; 0: keep), ``reference`` [B, 3, 1, H, W]. Without a control
    video and with a mask, the control video is the clip with its masked pixels grey (0), as VACE's own
    inpainting input; without both, zeros and an all-ones mask (the pipeline's defaults)."""
    mask = conditions.get("mask")
    mask = torch.ones_like(pixels[:, :1]) if mask is None else (mask.to(pixels) > 0.5).to(pixels.dtype)
    control = conditions.get("control")
    if control is None:
        control = pixels * (1 - mask) if "mask" in conditions else torch.zeros_like(pixels)
    control = control.to(pixels)
    inactive, reactive = encode(control * (1 - mask)), encode(control * mask)
    latents = encode(pixels)
    context = torch.cat([inactive, reactive, pack_mask(mask, latents.shape[2], stride).to(latents)], dim=1)
    reference = conditions.get("reference")
    if reference is not None:
        ref = encode(reference.to(pixels))
        ref_context = torch.cat([ref, torch.zeros_like(ref), torch.zeros_like(context[:, 32:, :1])], dim=1)
        context = torch.cat([ref_context, context], dim=2)
        latents = torch.cat([ref, latents], dim=2)
    return {"latents": latents, "vace_context": context}


def first_last_condition(encode, pixels: torch.Tensor) -> torch.Tensor:
    """I2V-A14B's ``cond_latents`` [B, 20, f, h, w] for first-last-frame, as ``WanImageToVideoPipeline.
    prepare_latents`` with ``last_image``: the mask (4 channels, one per pixel frame of a latent frame) is 1 on
    latent frame 0 in all four and on the last latent frame in channel 3 only (its fourth pixel frame, the clip's
    last; the first latent frame stands for one pixel frame, repeated 4 times), then the latents of
    ``[first frame, zeros..., last frame]`` encoded as a whole."""
    video = torch.zeros_like(pixels)
    video[:, :, :1], video[:, :, -1:] = pixels[:, :, :1], pixels[:, :, -1:]
    y = encode(video)
    mask = torch.zeros(y.shape[0], 4, *y.shape[2:], device=y.device, dtype=y.dtype)
    mask[:, :, 0] = 1.0
    mask[:, 3, -1] = 1.0
    return torch.cat([mask, y], dim=1)
