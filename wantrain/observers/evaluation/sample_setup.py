"""The sample observer built from ``[sample]`` (``samples.py``): each prompt encoded while the text encoder is
loaded, its first frame read, its stacked LoRA files checked, the training clips' motion measured once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from wantrain.core.adapter import ExpertServing, LoraStacking, TextEncoding, check_needs
from wantrain.observers.evaluation.motion import clip_motion
from wantrain.observers.evaluation.samples import SampleJob, SampleVideos

log = structlog.get_logger("wantrain.samples")


def _check_stacked(adapter: Any, loras: Sequence[Any]) -> None:
    """Read the stacked LoRA files now: a file diffusers cannot read is refused before training; unmatched keys
    are said once."""
    stacked = list({(lora.path, lora.strength, lora.expert): lora for lora in loras}.values())
    if stacked:
        check_needs("SampleVideos", adapter, needs=(LoraStacking,))
        for line in adapter.check_stacked_loras(stacked):
            log.warning("stacked_lora_unmatched", detail=line)


def _clip_conditions(spec: Any, data: Any, i: int, p: Any) -> dict[str, Any]:
    """The pipeline arguments a sample takes from clip ``i`` of ``data`` at the prompt's size: for VACE
    (``WanVACEPipeline``) its control video (``video``), ``mask`` and reference image (``reference_images``), those
    it has; for first-last-frame I2V its last frame (``last_image``; the first is the prompt's ``image``)."""
    from PIL import Image

    inputs = data.sample_inputs(i, p.width, p.height, p.frames)
    if spec.conditioning != "vace":
        return {"last_image": Image.fromarray(inputs["frames"][-1])}
    out: dict[str, Any] = {}
    if "control" in inputs:
        out["video"] = [Image.fromarray(f) for f in inputs["control"]]
    if "mask" in inputs:
        out["mask"] = [Image.fromarray(f).convert("L") for f in inputs["mask"]]
        if "video" not in out:  # the clip, grey where the mask says generate: the input it trained with
            keep = inputs["mask"].mean(axis=-1, keepdims=True) <= 127.5
            grey = np.where(keep, inputs["frames"], np.uint8(128)).astype(np.uint8)
            out["video"] = [Image.fromarray(f) for f in grey]
    if "ref" in inputs:
        out["reference_images"] = [Image.fromarray(inputs["ref"][0])]
    return out


def build_sample_observer(cfg: Any, spec: Any, adapter: Any, run_dir: Path, *, sync: Any = None,
                          clips: Sequence[tuple[Any, int, str]] = (),
                          prompt_embeds: Mapping[str, torch.Tensor] | None = None,
                          clip_videos: Callable[[int, int], Iterable[np.ndarray]] | None = None) -> Any:
    """The observer of ``cfg.sample``: encodes each prompt (and negative prompt) now, while the text encoder is
    loaded, keeping the embeddings on the CPU (``prompt_embeds``: embeddings encoded already, by text, before the
    experts loaded: nothing is encoded); reads the first-frame images. An I2V prompt without an image takes the
    first frame of ``clips[index % len(clips)]`` at its sample size (logged as ``sample_first_frame``). torchrun
    ranks other than 0 encode nothing: they wait while rank 0 samples (under fsdp or Ulysses repeating its calls).
    ``clip_videos(width, height)``: the training clips' frames at that size (uint8 ``[F, H, W, 3]`` each),
    measured once at the first video prompt's
    size for ``samples/motion_ratio`` (logged as ``clip_motion``)."""
    from PIL import Image

    def embed(text: str) -> torch.Tensor:
        if prompt_embeds is not None:
            return prompt_embeds[text]
        return adapter.encode_text([text])["text_embeds"].cpu()

    s = cfg.sample
    main = sync is None or sync.is_main
    if main:
        check_needs("SampleVideos", adapter, needs=(*SampleVideos.needs, TextEncoding))  # before encoding anything
    elif hasattr(sync, "relays"):  # expert groups: the rank that serves rank 0's calls of its expert
        for served, relay in sync.relays().items():
            if relay.serves:
                check_needs("SampleVideos", adapter, needs=(ExpertServing,))
                _check_stacked(adapter, [lora for p in s.resolved(spec) for lora in p.loras
                                         if lora.expert in ("both", served)])
    jobs = []
    negatives: dict[str, torch.Tensor] = {}
    for p in s.resolved(spec) if main else ():
        negative = None
        if p.guided:
            if p.negative_prompt not in negatives:
                negatives[p.negative_prompt] = embed(p.negative_prompt)
            negative = negatives[p.negative_prompt]
        image, source = None, None
        if p.image is not None:
            with Image.open(p.image) as im:
                image, source = im.convert("RGB"), str(p.image)
        elif spec.conditioning == "i2v" and clips:
            data, i, kind = clips[p.index % len(clips)]
            clip = data.clips[i]
            image = Image.fromarray(data.first_frame(i, p.width, p.height))
            source = f"{clip.path} (frame {clip.start})" if clip.kind == "video" else str(clip.path)
            log.info("sample_first_frame", prompt=p.index, source=source,
                     reason=f"the prompt has no image: the first frame of a {kind}")
        conditions = {}
        if clips and (spec.conditioning == "vace" or getattr(cfg.model, "condition", None) == "first_last"):
            data, i, kind = clips[p.index % len(clips)]
            conditions = _clip_conditions(spec, data, i, p)
            log.info("sample_conditions", prompt=p.index, source=str(data.clips[i].path), kind=kind,
                     inputs=sorted(conditions))
        jobs.append(SampleJob(
            index=p.index, prompt_embeds=embed(p.prompt),
            negative_embeds=negative, width=p.width, height=p.height, frames=p.frames, seed=p.seed, steps=p.steps,
            guidance_scale=p.guidance_scale, guidance_scale_high_noise=p.guidance_scale_high_noise, image=image,
            image_source=source, loras=p.loras, conditions=conditions,
        ))
    _check_stacked(adapter, [lora for job in jobs for lora in job.loras])
    reference = None
    video = next((j for j in jobs if j.frames > 1), None)
    if clip_videos is not None and video is not None:
        reference = clip_motion(clip_videos(video.width, video.height))
        log.info("clip_motion", motion=reference, width=video.width, height=video.height,
                 unit="mean optical-flow magnitude, pixels per frame")
    note = None
    if spec.tiny:
        note = (f"{spec.name} is a random toy model: its VAE cannot draw, so the decoded frames look like noise "
                "at every step; the *_latents.png beside each video (and samples/NN/latents in TensorBoard) show "
                "its latents, and from the second round on *_change.png puts them beside step 0's with their "
                "difference: what the LoRA changed")
    return SampleVideos(
        out_dir=Path(run_dir) / "samples", jobs=jobs, every=s.every, fps=s.fps or spec.target_fps,
        tensorboard_dir=Path(run_dir) / "tensorboard" if cfg.observers.tensorboard else None, sync=sync, note=note,
        clip_motion=reference,
    )
