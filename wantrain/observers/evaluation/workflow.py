"""A ComfyUI workflow beside every saved LoRA set: the graph that renders the run's first sample prompt in ComfyUI.

``<name>_step000200.workflow.json`` (and ``<name>.workflow.json`` with the final files) in ComfyUI's API format
(``{"<id>": {"class_type": ..., "inputs": {...}, "_meta": {"title": ...}}}``; a link is ``[source id, output
index]``), ComfyUI's built-in nodes only:

* ``UNETLoader`` per expert, ``CLIPLoader`` (type ``wan``), ``VAELoader``: the config's single files by name
  (``model.high_noise_file``, ``text_encoder_file``, ...), else the names ComfyUI's folders usually hold
  (Comfy-Org's repackaged Wan 2.2 files; each loader's title says which it is);
* ``LoraLoaderModelOnly`` per expert at strength 1.0 with this save's file (and ``sample.other_expert_lora`` on
  the expert the run does not train), after the prompt's stacked LoRAs (``loras``) at their strengths, then
  ``ModelSamplingSD3`` with the shift of the sampling scheduler;
* ``CLIPTextEncode`` for the prompt and the negative prompt;
* the latent: ``EmptyHunyuanLatentVideo`` (T2V), ``WanImageToVideo`` with ``LoadImage`` (I2V A14B),
  ``WanFirstLastFrameToVideo`` with two ``LoadImage`` (I2V A14B with ``model.condition = "first_last"``:
  ``first_frame.png``, ``last_frame.png``), ``WanVaceToVideo`` with the control video (``LoadVideo`` ->
  ``GetVideoComponents``: ``control_video.mp4``) for the VACE variants, whose reference frames ``TrimVideoLatent``
  cuts off after sampling, ``Wan22ImageToVideoLatent`` (TI2V-5B, with ``LoadImage`` when the prompt has an image);
* A14B: two ``KSamplerAdvanced`` split at the expert boundary -- the high-noise expert denoises steps
  ``[0, k)`` and hands its leftover noise to the low-noise expert for ``[k, steps)``, where ``k`` is the number
  of the sampling scheduler's timesteps at or above ``boundary_ratio * 1000`` (diffusers' rule); the high-noise
  steps use ``guidance_scale_high_noise``, the low-noise ones ``guidance_scale``. TI2V-5B: one ``KSampler``;
* ``VAEDecode`` and ``SaveAnimatedWEBP`` at the sample's frame rate.

The sampler is ``uni_pc`` with the ``simple`` schedule, ComfyUI's counterpart of the trainer's
``UniPCMultistepScheduler`` with flow sigmas. ComfyUI draws its initial noise its own way, so the same seed gives
another video than the trainer's sample; the settings (prompt, size, frames, steps, guidance, shift, split, LoRA
strengths) are the same. A replayed run (no model) writes none; under torchrun only rank 0 writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog

from wantrain.core.atomic import atomic_write
from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import CheckpointSaved
from wantrain.observers.evaluation.config import PromptSettings

log = structlog.get_logger("wantrain.workflow")

SAMPLER, SCHEDULER = "uni_pc", "simple"
END_OF_SCHEDULE = 10000  # KSamplerAdvanced's end_at_step default: "to the last step"
PLACEHOLDER_PROMPT = "describe the video, with the words the LoRA was trained on"

# The files ComfyUI's folders usually hold for each variant (Comfy-Org's repackaged Wan 2.2 release,
# Comfy-Org/Wan_2.2_ComfyUI_Repackaged split_files/diffusion_models/: the VACE-Fun pair is there in bf16 and in
# fp8_scaled): used for a run from a diffusers folder or another layout, whose weights have no single file of their own.
COMFY_FILES: dict[str, dict[str, str]] = {
    "t2v": {"high_noise": "wan2.2_t2v_high_noise_14B_fp16.safetensors",
            "low_noise": "wan2.2_t2v_low_noise_14B_fp16.safetensors", "vae": "wan_2.1_vae.safetensors"},
    "i2v": {"high_noise": "wan2.2_i2v_high_noise_14B_fp16.safetensors",
            "low_noise": "wan2.2_i2v_low_noise_14B_fp16.safetensors", "vae": "wan_2.1_vae.safetensors"},
    "ti2v": {"single": "wan2.2_ti2v_5B_fp16.safetensors", "vae": "wan2.2_vae.safetensors"},
    "vace": {"high_noise": "wan2.2_fun_vace_high_noise_14B_bf16.safetensors",
             "low_noise": "wan2.2_fun_vace_low_noise_14B_bf16.safetensors", "vae": "wan_2.1_vae.safetensors"},
}
COMFY_FILES["first_last"] = COMFY_FILES["i2v"]
CONTROL_VIDEO = "control_video.mp4"  # the VACE workflow's control video (put it in ComfyUI's input folder)
COMFY_TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"


@attrs.frozen
class WorkflowSettings:
    """What the graph renders: the first sample prompt's settings (``PromptSettings`` of ``[sample]``), the
    model files, the shift and the step at which the low-noise expert takes over (None: one transformer)."""

    conditioning: str  # "t2v", "i2v", "first_last" (I2V on first and last frames), "ti2v" or "vace"
    sample: PromptSettings  # the first prompt's (image: the file name the LoadImage node reads)
    fps: float
    shift: float
    switch_step: int | None
    files: dict[str, str]  # "high_noise"/"low_noise"/"single", "vae", "text_encoder" -> file name
    file_notes: dict[str, str]  # same keys -> where the name comes from
    other_lora: dict[str, str] = attrs.field(factory=dict)  # an untrained expert -> its LoRA file name


def workflow_path(lora_path: str | Path, expert: str | None) -> Path:
    """``run/x_step000200_high_noise.safetensors`` -> ``run/x_step000200.workflow.json``."""
    path = Path(lora_path)
    stem = path.name.removesuffix(".safetensors")
    if expert is not None:
        stem = stem.removesuffix(f"_{expert}")
    return path.with_name(f"{stem}.workflow.json")


def switch_step(scheduler: Any, steps: int, boundary: float | None) -> int | None:
    """How many of ``steps`` denoising steps the high-noise expert runs: the scheduler's timesteps at or above
    ``boundary * num_train_timesteps`` (diffusers' Wan pipelines switch at the first one below)."""
    if boundary is None:
        return None
    scheduler.set_timesteps(steps)
    limit = boundary * scheduler.config.num_train_timesteps
    return sum(1 for t in scheduler.timesteps.tolist() if t >= limit)


def build_workflow(s: WorkflowSettings, loras: dict[str | None, str], prefix: str) -> dict[str, Any]:
    """The API-format graph (see the module docstring). ``loras``: expert -> LoRA file name of this save."""
    graph: dict[str, Any] = {}
    p = s.sample

    def node(class_type: str, title: str, **inputs: Any) -> list[Any]:
        key = str(len(graph) + 1)
        graph[key] = {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}
        return [key, 0]

    def out(link: list[Any], index: int) -> list[Any]:
        return [link[0], index]

    clip = node("CLIPLoader", f"Text encoder ({s.file_notes['text_encoder']})", clip_name=s.files["text_encoder"],
                type="wan", device="default")
    vae = node("VAELoader", f"VAE ({s.file_notes['vae']})", vae_name=s.files["vae"])
    positive = node("CLIPTextEncode", "Prompt", text=p.prompt, clip=clip)
    negative = node("CLIPTextEncode", "Negative prompt", text=p.negative_prompt, clip=clip)
    image = node("LoadImage", "First frame (put it in ComfyUI's input folder)", image=p.image) if p.image else None
    experts = ["single"] if s.switch_step is None else ["high_noise", "low_noise"]
    models = {}
    for expert in experts:
        label = expert.replace("_", "-")
        model = node("UNETLoader", f"{label} model ({s.file_notes[expert]})", unet_name=s.files[expert],
                     weight_dtype="default")
        for extra in p.loras:  # the prompt's stacked LoRAs (a speed-up LoRA), under the trained one
            if extra.expert in ("both", expert):
                model = node("LoraLoaderModelOnly", f"{label} stacked LoRA (sample.loras)", model=model,
                             lora_name=Path(extra.path).name, strength_model=float(extra.strength))
        lora = loras.get(None if expert == "single" else expert) or s.other_lora.get(expert)
        if lora is not None:
            model = node("LoraLoaderModelOnly", f"{label} LoRA", model=model, lora_name=lora, strength_model=1.0)
        models[expert] = node("ModelSamplingSD3", f"{label} shift", model=model, shift=s.shift)
    size = dict(width=p.width, height=p.height, length=p.frames, batch_size=1)
    trim = None
    if s.conditioning == "first_last":
        last = node("LoadImage", "Last frame (put it in ComfyUI's input folder)", image="last_frame.png")
        latent_node = node("WanFirstLastFrameToVideo", "First and last frame to video", positive=positive,
                           negative=negative, vae=vae, start_image=image, end_image=out(last, 0), **size)
        positive, negative, latent = out(latent_node, 0), out(latent_node, 1), out(latent_node, 2)
    elif s.conditioning == "vace":
        video = node("LoadVideo", "Control video (put it in ComfyUI's input folder)", file=CONTROL_VIDEO)
        frames_in = node("GetVideoComponents", "Control frames", video=video)
        latent_node = node("WanVaceToVideo", "VACE", positive=positive, negative=negative, vae=vae, strength=1.0,
                           control_video=out(frames_in, 0), **size)
        positive, negative, latent = out(latent_node, 0), out(latent_node, 1), out(latent_node, 2)
        trim = out(latent_node, 3)
    elif s.conditioning == "i2v":
        latent_node = node("WanImageToVideo", "Image to video", positive=positive, negative=negative, vae=vae,
                           start_image=image, **size)
        positive, negative, latent = out(latent_node, 0), out(latent_node, 1), out(latent_node, 2)
    elif s.conditioning == "ti2v":
        latent = node("Wan22ImageToVideoLatent", "Latent", vae=vae, **size, **({"start_image": image} if image else {}))
    else:
        latent = node("EmptyHunyuanLatentVideo", "Latent", **size)
    common = dict(positive=positive, negative=negative, sampler_name=SAMPLER, scheduler=SCHEDULER)
    if s.switch_step is None:
        latent = node("KSampler", "Sampler", model=models["single"], seed=p.seed, steps=p.steps,
                      cfg=p.guidance_scale, latent_image=latent, denoise=1.0, **common)
    else:
        latent = node("KSamplerAdvanced", f"High-noise steps 0-{s.switch_step}", model=models["high_noise"],
                      add_noise="enable", noise_seed=p.seed, steps=p.steps, cfg=p.guidance_scale_high_noise,
                      latent_image=latent, start_at_step=0, end_at_step=s.switch_step,
                      return_with_leftover_noise="enable", **common)
        latent = node("KSamplerAdvanced", f"Low-noise steps {s.switch_step}-{p.steps}", model=models["low_noise"],
                      add_noise="disable", noise_seed=p.seed, steps=p.steps, cfg=p.guidance_scale,
                      latent_image=latent, start_at_step=s.switch_step, end_at_step=END_OF_SCHEDULE,
                      return_with_leftover_noise="disable", **common)
    if trim is not None:  # the reference image's latent frames (none here: no reference_image input)
        latent = node("TrimVideoLatent", "Cut the reference frames", samples=latent, trim_amount=trim)
    frames = node("VAEDecode", "Decode", samples=latent, vae=vae)
    node("SaveAnimatedWEBP", "Save", images=frames, filename_prefix=prefix, fps=float(s.fps), lossless=False,
         quality=90, method="default")
    return graph


class ComfyWorkflow(Observer):
    """Writes ``<stem>.workflow.json`` beside each saved LoRA set (``CheckpointSaved`` with LoRA paths)."""

    priority = Priority.SINK

    def __init__(self, settings: WorkflowSettings, experts: Sequence[str | None]) -> None:
        self.settings = settings
        self.experts = tuple(experts)

    @on(CheckpointSaved)
    def on_saved(self, event: CheckpointSaved, ctx) -> None:
        if not event.paths or ctx.adapter is None:  # a checkpoint-only save; a replay writes no files
            return
        self.write(event.paths)

    def write(self, paths: Sequence[str]) -> Path:
        """The workflow of the LoRA files ``paths`` (one per trained expert, in the adapter's order)."""
        loras = {e: Path(p).name for e, p in zip(self.experts, paths, strict=True)}
        path = workflow_path(paths[0], self.experts[0])
        graph = build_workflow(self.settings, loras, prefix=f"wantrain/{path.name.removesuffix('.workflow.json')}")
        text = json.dumps(graph, indent=1) + "\n"
        atomic_write(path, lambda tmp: Path(tmp).write_text(text), what="ComfyUI workflow")
        log.info("workflow_written", path=str(path))
        return path


def workflow_settings(cfg: Any, spec: Any, scheduler: Any) -> WorkflowSettings:
    """The settings of ``cfg`` (a ``RunConfig``): its first sample prompt (a placeholder without ``[sample]``
    prompts, then the section's defaults), its model files, ``scheduler``'s shift and split."""
    prompts = cfg.sample.resolved(spec)
    if prompts:
        p = prompts[0]
    else:  # no prompts: a placeholder with the section's settings
        with_placeholder = attrs.evolve(cfg.sample, prompts=[PLACEHOLDER_PROMPT])
        (p,) = with_placeholder.resolved(spec)
    model = cfg.model
    family = spec.conditioning
    if family == "i2v" and getattr(model, "condition", "first_frame") == "first_last":
        family = "first_last"
    usual = COMFY_FILES[family]
    files, notes = {}, {}
    own = {"high_noise": model.high_noise_file, "low_noise": model.low_noise_file, "single": model.transformer_file,
           "vae": model.vae_file, "text_encoder": model.text_encoder_file}
    for key in (*(k for k in usual if k != "vae"), "vae", "text_encoder"):
        if own[key] is not None and Path(own[key]).suffix == ".safetensors":
            files[key], notes[key] = Path(own[key]).name, f"model.{'transformer' if key == 'single' else key}_file"
        else:
            files[key] = usual.get(key, COMFY_TEXT_ENCODER)
            notes[key] = "ComfyUI's usual file name; this run read a diffusers folder or another format"
    other = {}
    if cfg.sample.other_expert_lora is not None:
        for expert in model.untrained_experts:
            other[expert] = Path(cfg.sample.other_expert_lora).name
    image = p.image if p.image is not None or family not in ("i2v", "first_last") else "first_frame.png"
    shift = float(getattr(scheduler.config, "flow_shift", None) or getattr(scheduler.config, "shift", 1.0))
    return WorkflowSettings(
        conditioning=family, sample=attrs.evolve(p, image=Path(image).name if image is not None else None),
        fps=cfg.sample.fps or spec.target_fps, shift=shift,
        switch_step=switch_step(scheduler, p.steps, spec.boundary_ratio), files=files, file_notes=notes,
        other_lora=other,
    )
