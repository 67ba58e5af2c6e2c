"""Config sections ``[validation]`` (fixed-timestep validation loss) and ``[sample]`` (sample videos), read by
``wantrain/observers/evaluation/validation.py`` and ``samples.py``; see docs/validation.md.

Checks that need only the section happen here (one line naming the key); checks against the model variant (image
count, sizes) happen in :func:`section_file_problems`, which the pre-flight asks (``app.run_plan``, ``app.preflight``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs

from wantrain.core.config import at_least, between, section, setting
from wantrain.core.problems import Problem, Rule, bad_value, refuse

DEFAULT_TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)


@section
class ValidationConfig:
    """Validation loss at fixed timesteps and noise seeds (docs/validation.md)."""

    enabled: bool = setting(False, doc="Compute `val/loss` at step 0, every `every` steps and at the end.")
    path: Path | None = setting(
        None, doc="Folder of validation clips (same format as training data, cached the same way). "
        "Use either this or `from_training`."
    )
    from_training: int | None = setting(
        None, doc="Validate on the first N training clips (in folder order) instead of a folder.", range=at_least(1)
    )
    every: int = setting(100, doc="Validate every N optimizer steps (besides step 0 and the end).", range=at_least(1))
    every_epochs: int | None = setting(
        None, doc="Validate every N epochs instead (the optimizer steps of the first N epochs; replaces `every`).",
        range=at_least(1))
    timesteps: list[float] = setting(
        factory=lambda: list(DEFAULT_TIMESTEPS),
        doc="Timesteps t in (0, 1) evaluated, each by the expert that owns it (`val/loss/t_0.5`, ...).",
    )
    seed: int = setting(0, doc="Seed of the fixed noise (its own generator; training randomness is untouched).",
                        range=between(0, 2**63 - 1))
    max_clips: int = setting(16, doc="At most this many validation clips (the first ones).", range=at_least(1))

    def __attrs_post_init__(self) -> None:
        """Every problem of the section (``core.problems.refuse``: collected by the loader, raised in code)."""
        found = []
        if not self.timesteps or any(not 0.0 < t < 1.0 for t in self.timesteps):
            found.append(bad_value("validation.timesteps", f"config key 'validation.timesteps' = {self.timesteps!r}: "
                                   "give one or more timesteps strictly between 0 and 1, for example [0.1, 0.3, 0.5, "
                                   "0.7, 0.9]"))
        elif len(set(self.timesteps)) != len(self.timesteps):
            found.append(bad_value("validation.timesteps",
                                   f"config key 'validation.timesteps' = {self.timesteps!r} repeats a timestep"))
        if self.enabled and (self.path is None) == (self.from_training is None):
            found.append(bad_value("validation.path", "[validation] is enabled: set exactly one of 'validation.path' "
                                   "(a folder of clips) and 'validation.from_training' (a number of training clips)"))
        refuse(found)


PROMPT_KEYS = ("width", "height", "frames", "seed", "steps", "guidance_scale", "guidance_scale_high_noise",
               "negative_prompt", "image", "loras")
"""The options a prompt of ``[sample]`` may set for itself (the section's values are the defaults)."""


@section
class StackedLora:
    """A LoRA file applied under the trained one while sampling (`sample.loras`, a prompt's `loras`): a speed-up
    (distillation) LoRA, a style. Never trained, saved or checkpointed."""

    path: Path = setting(doc="A Wan 2.2 LoRA .safetensors in a key format diffusers' Wan loader reads (ComfyUI / "
                         "original Wan, kijai, lightx2v, musubi-tuner, diffusers).")
    strength: float = setting(1.0, doc="Its multiplier (ComfyUI's strength_model).")
    expert: Literal["both", "high_noise", "low_noise"] = setting(
        "both", doc="The A14B expert(s) it applies to (the 5B: `both`).")


@section
class SamplePrompt:
    """One prompt of `sample.prompts` with options of its own (`prompts = ["text", {prompt = "text", frames = 17}]`
    or `[[sample.prompts]]` tables); unset options take the section's values."""

    prompt: str = setting(doc="The prompt.")
    width: int | None = setting(None, doc="Width in pixels.", range=at_least(16))
    height: int | None = setting(None, doc="Height in pixels.", range=at_least(16))
    frames: int | None = setting(None, doc="Frames (4k+1).", range=at_least(1))
    seed: int | None = setting(None, doc="Seed of this video's initial noise (unset: `sample.seed` + its index).",
                               range=between(0, 2**63 - 1))
    steps: int | None = setting(None, doc="Inference (denoising) steps.", range=at_least(1))
    guidance_scale: float | None = setting(None, doc="Classifier-free guidance scale.", range=at_least(1.0))
    guidance_scale_high_noise: float | None = setting(
        None, doc="Guidance of the high-noise expert's steps (A14B).", range=at_least(1.0))
    negative_prompt: str | None = setting(None, doc="Negative prompt.")
    image: Path | None = setting(None, doc="First-frame image (I2V; TI2V: image-to-video).")
    loras: list[StackedLora] | None = setting(
        None, doc="LoRA files stacked under the trained one for this prompt (replaces `sample.loras`; `[]`: none).")


@attrs.frozen
class PromptSettings:
    """Everything one sample video is made with: a prompt's own options over the section's."""

    index: int
    prompt: str
    width: int
    height: int
    frames: int
    seed: int
    steps: int
    guidance_scale: float  # the low-noise expert's steps (every step of a single-transformer model)
    guidance_scale_high_noise: float
    negative_prompt: str
    image: Path | None
    loras: tuple[StackedLora, ...] = ()

    @property
    def guided(self) -> bool:
        """Whether diffusers runs the negative pass: its rule is the first (high-noise) stage's scale > 1."""
        return self.guidance_scale_high_noise > 1.0


@section
class SampleConfig:
    """Sample videos generated during training with diffusers' Wan pipelines (docs/validation.md)."""

    enabled: bool = setting(False, doc="Generate sample videos at step 0, every `every` steps and at the end.")
    prompts: list[str | SamplePrompt] = setting(
        factory=list, doc="One video per prompt (`samples/step_000200_00.mp4`, ...): a string, or a table with "
        "`prompt` and options of its own (`[[sample.prompts]]`, the keys below).")
    images: list[Path] = setting(
        factory=list, doc="First-frame images, one per prompt: optional for I2V (a prompt without one takes the "
        "first frame of a validation or training clip) and TI2V (image-to-video when given), refused for T2V."
    )
    every: int = setting(200, doc="Sample every N optimizer steps (besides step 0 and the end).", range=at_least(1))
    every_epochs: int | None = setting(
        None, doc="Sample every N epochs instead (the optimizer steps of the first N epochs; replaces `every`).",
        range=at_least(1))
    frames: int | None = setting(None, doc="Frames per video (4k+1); unset: the variant's default.",
                                 range=at_least(1))
    width: int | None = setting(None, doc="Width in pixels; unset: the variant's default.", range=at_least(16))
    height: int | None = setting(None, doc="Height in pixels; unset: the variant's default.", range=at_least(16))
    steps: int = setting(30, doc="Inference (denoising) steps.", range=at_least(1))
    guidance_scale: float = setting(5.0, doc="Classifier-free guidance scale (1 disables the negative pass).",
                                    range=at_least(1.0))
    guidance_scale_high_noise: float | None = setting(
        None, doc="Guidance of the high-noise expert's steps (A14B; diffusers' `guidance_scale`, while "
        "`guidance_scale` is its `guidance_scale_2`); unset: `guidance_scale`.", range=at_least(1.0))
    negative_prompt: str = setting("", doc="Negative prompt used with guidance.")
    seed: int = setting(42, doc="Seed of each video's initial noise (video i uses seed + i).",
                        range=between(0, 2**63 - 1))
    fps: float | None = setting(None, doc="Frame rate written to the mp4 files; unset: the variant's.",
                                range=at_least(1.0))
    loras: list[StackedLora] = setting(
        factory=list, doc="LoRA files stacked under the trained one while sampling every prompt without `loras` of "
        "its own: tables of `path`, `strength` (1.0) and `expert` (`both`); never trained or saved.")
    other_expert_lora: Path | None = setting(
        None, doc="With one A14B expert trained (`model.experts`), a LoRA file for the other expert, applied while "
        "sampling its timesteps (e.g. a `_high_noise.safetensors` of an earlier run); unset: its base weights.")

    def __attrs_post_init__(self) -> None:
        """Every problem of the section (``core.problems.refuse``: collected by the loader, raised in code)."""
        found = []
        if self.enabled and not self.prompts:
            found.append(bad_value("sample.prompts", "[sample] is enabled but 'sample.prompts' is empty; give one or "
                                   "more prompts"))
        if self.frames is not None and (self.frames - 1) % 4:
            found.append(bad_value("sample.frames", f"config key 'sample.frames' = {self.frames}: use a count of the "
                                   "form 4k+1 (1, 5, 9, ..., 81)"))
        for i, p in enumerate(self.prompts):
            if isinstance(p, SamplePrompt) and p.frames is not None and (p.frames - 1) % 4:
                found.append(bad_value(f"sample.prompts[{i}].frames", f"config key 'sample.prompts[{i}].frames' = "
                                       f"{p.frames}: use a count of the form 4k+1 (1, 5, 9, ..., 81)"))
            if isinstance(p, SamplePrompt) and p.image is not None and i < len(self.images):
                found.append(bad_value(f"sample.prompts[{i}].image", f"prompt {i} has an image twice: "
                                       f"'sample.prompts[{i}].image' and 'sample.images[{i}]'; keep one"))
        if len(self.images) > len(self.prompts):
            found.append(bad_value("sample.images", f"config key 'sample.images' has {len(self.images)} images for "
                                   f"{len(self.prompts)} prompts; give at most one per prompt"))
        refuse(found)

    def resolved(self, spec: Any) -> list[PromptSettings]:
        """Each prompt's settings: its own options, else the section's, else the variant's defaults."""
        width, height = spec.default_resolution
        out = []
        for i, p in enumerate(self.prompts):
            own = p if isinstance(p, SamplePrompt) else SamplePrompt(prompt=p)

            def pick(key: str, default: Any, source: Any = own) -> Any:
                value = getattr(source, key)
                return default if value is None else value

            low = pick("guidance_scale", self.guidance_scale)
            # the prompt's high-noise guidance, else the section's, else the prompt's guidance_scale
            high = pick("guidance_scale_high_noise", pick("guidance_scale_high_noise", low, self))
            out.append(PromptSettings(
                index=i, prompt=own.prompt, width=pick("width", self.width or width),
                height=pick("height", self.height or height), frames=pick("frames", self.frames or spec.default_frames),
                seed=pick("seed", self.seed + i), steps=pick("steps", self.steps), guidance_scale=low,
                guidance_scale_high_noise=high, negative_prompt=pick("negative_prompt", self.negative_prompt),
                image=pick("image", self.images[i] if i < len(self.images) else None),
                loras=tuple(pick("loras", self.loras)),
            ))
        return out


def sample_size(cfg: SampleConfig, spec: Any) -> tuple[int, int, int]:
    """(width, height, frames) of the largest sample (the memory estimate's), unset values taken from the
    variant."""
    prompts = cfg.resolved(spec) or [None]
    if prompts == [None]:
        width, height = spec.default_resolution
        return cfg.width or width, cfg.height or height, cfg.frames or spec.default_frames
    big = max(prompts, key=lambda p: p.width * p.height * p.frames)
    return big.width, big.height, big.frames


def section_file_problems(validation: ValidationConfig, sample: SampleConfig, spec: Any,
                          experts: tuple) -> list[Problem]:
    """The problems of [validation] and [sample] against the model variant (``spec``), the trained ``experts`` and
    the files they name (images, LoRA files: headers only), every one; ``check`` and ``run`` ask them once the
    config's rules hold (``app.preflight``, ``app.run_plan``)."""
    found = []
    if validation.enabled:
        if validation.path is not None and not Path(validation.path).is_dir():
            found.append(bad_value("validation.path", f"config key 'validation.path' = '{validation.path}' is not a "
                                   "folder; give a folder of clips with captions, or use 'validation.from_training'"))
        if not any(expert_for_t(t, spec.boundary_ratio, experts) != "untrained" for t in validation.timesteps):
            trained = ", ".join(str(e) for e in experts)
            found.append(bad_value("validation.timesteps", f"config key 'validation.timesteps' = "
                                   f"{validation.timesteps!r}: none falls in the band of a trained expert ({trained}; "
                                   f"the boundary is t = {spec.boundary_ratio})"))
    if not sample.enabled:
        return found
    return found + _sample_problems(sample, spec, experts)


def _sample_problems(sample: SampleConfig, spec: Any, experts: tuple) -> list[Problem]:
    found = []
    multiple = spec.spatial_multiple
    for p in sample.resolved(spec):
        own = sample.prompts[p.index]
        where = f"sample.prompts[{p.index}]." if isinstance(own, SamplePrompt) else "sample."
        for key, value in (("width", p.width), ("height", p.height)):
            if value % multiple:
                prefix = where if isinstance(own, SamplePrompt) and getattr(own, key) is not None else "sample."
                found.append(bad_value(f"{prefix}{key}", f"config key '{prefix}{key}' = {value}: {spec.name} needs a "
                                       f"multiple of {multiple}"))
        image_key = (f"sample.prompts[{p.index}].image" if isinstance(own, SamplePrompt) and own.image is not None
                     else f"sample.images[{p.index}]")
        if p.image is not None:
            if spec.conditioning in ("t2v", "vace"):  # VACE samples take a clip's control files, not an image
                found.append(bad_value(image_key, f"config key '{image_key}' is set but {spec.name} is text-to-video"
                                       + (" (its samples take a clip's control files)"
                                          if spec.conditioning == "vace" else "") + "; remove it"))
            elif not Path(p.image).is_file():
                found.append(bad_value(image_key, f"config key '{image_key}' = '{p.image}' does not exist (an image "
                                       "file)"))
            else:
                found += _image_problems(image_key, Path(p.image))
        if spec.boundary_ratio is None and isinstance(own, SamplePrompt) and own.guidance_scale_high_noise is not None:
            found.append(bad_value(f"sample.prompts[{p.index}].guidance_scale_high_noise", "config key "
                                   f"'sample.prompts[{p.index}].guidance_scale_high_noise' applies to the two-expert "
                                   f"A14B variants; {spec.name} has one transformer: use guidance_scale"))
        if p.guidance_scale_high_noise == 1.0 and p.guidance_scale > 1.0 and spec.boundary_ratio is not None:
            found.append(bad_value("sample.guidance_scale_high_noise", f"prompt {p.index}: guidance_scale_high_noise "
                                   f"= 1 with guidance_scale = {p.guidance_scale:g}: diffusers runs the negative pass "
                                   "only when the high-noise scale is above 1, so the low-noise guidance would be "
                                   "ignored; raise guidance_scale_high_noise above 1 or set guidance_scale = 1"))
    if spec.boundary_ratio is None and sample.guidance_scale_high_noise is not None:
        found.append(bad_value("sample.guidance_scale_high_noise", "config key 'sample.guidance_scale_high_noise' "
                               f"applies to the two-expert A14B variants; {spec.name} has one transformer: use "
                               "sample.guidance_scale"))
    for p in sample.resolved(spec):
        for j, lora in enumerate(p.loras):
            own = sample.prompts[p.index]
            key = (f"sample.prompts[{p.index}].loras[{j}]" if isinstance(own, SamplePrompt) and own.loras is not None
                   else f"sample.loras[{j}]")
            if not Path(lora.path).is_file():
                found.append(bad_value(f"{key}.path", f"config key '{key}.path' = '{lora.path}' does not exist (a LoRA "
                                       ".safetensors file)"))
            if lora.expert != "both" and spec.boundary_ratio is None:
                found.append(bad_value(f"{key}.expert", f"config key '{key}.expert' = '{lora.expert}': {spec.name} has "
                                       "one transformer; use 'both'"))
    if sample.other_expert_lora is not None:
        if spec.boundary_ratio is None or len(experts) != 1:
            found.append(bad_value("sample.other_expert_lora", "config key 'sample.other_expert_lora' is for a run "
                                   "that trains one expert of an A14B model (model.experts = 'high_noise' or "
                                   "'low_noise'); this run trains "
                                   f"{'the single transformer' if spec.boundary_ratio is None else 'both'}: remove it"))
        else:
            other = "low_noise" if experts[0] == "high_noise" else "high_noise"
            found += _lora_file_problems(Path(sample.other_expert_lora), other)
    return found


def check_sections(validation: ValidationConfig, sample: SampleConfig, spec: Any, experts: tuple) -> None:
    """:func:`section_file_problems` refused (every one; one line when one)."""
    refuse(section_file_problems(validation, sample, spec, experts))


def expert_for_t(t: float, boundary: float | None, experts: tuple) -> str | None:
    """The expert that owns ``t`` (high noise t >= boundary), or ``"untrained"`` when it is not trained."""
    if boundary is None:
        return experts[0]
    owner = "high_noise" if t >= boundary else "low_noise"
    return owner if owner in experts else "untrained"


def _image_problems(key: str, path: Path) -> list[Problem]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        return [bad_value(key, f"config key '{key}' = '{path}' is not a readable image ({exc})")]
    return []


def _lora_file_problems(path: Path, expert: str) -> list[Problem]:
    """``sample.other_expert_lora``: a readable safetensors file holding LoRA tensors, not one that says (in
    wantrain's metadata) it belongs to the other expert. Reads the header only."""
    from safetensors import SafetensorError, safe_open

    key = "sample.other_expert_lora"
    if not path.is_file():
        return [bad_value(key, f"config key '{key}' = '{path}' does not exist (a LoRA .safetensors file of the "
                               f"{expert} expert)")]
    try:
        with safe_open(str(path), framework="pt") as fh:
            names, meta = list(fh.keys()), fh.metadata() or {}
    except (SafetensorError, OSError) as exc:
        return [bad_value(key, f"config key '{key}' = '{path}' is not a readable safetensors file ({exc})")]
    if not any("lora" in n for n in names):
        return [bad_value(key, f"config key '{key}' = '{path}' holds no LoRA tensors (no 'lora' in its {len(names)} "
                               "key names)")]
    if meta.get("expert") not in (None, expert):
        return [bad_value(key, f"config key '{key}' = '{path}' is a LoRA of the {meta['expert']} expert (its "
                               f"metadata says so); the expert this run does not train is {expert}: give its file")]
    return []


EVALUATION_RULES = (
    OTHER_EXPERT_WITH_GROUPS := Rule("other-expert-lora-expert-groups", ("sample.other_expert_lora",
                                                                         "model.expert_groups"),
                                     "sample.other_expert_lora with expert groups",
                                     ("model.expert_groups > 1", "sample.other_expert_lora")),
)


def evaluation_problems(cfg: Any) -> list[Problem]:
    """[validation] and [sample] against the rest of the run config: with one expert per group of GPUs the other
    group trains the expert ``sample.other_expert_lora`` would load into."""
    if cfg.model.expert_groups > 1 and cfg.sample.enabled and cfg.sample.other_expert_lora is not None:
        return [OTHER_EXPERT_WITH_GROUPS.problem(
            f"config key 'sample.other_expert_lora' does nothing with model.expert_groups = {cfg.model.expert_groups}:"
            " the other group trains that expert and samples with it; remove the key, or set model.expert_groups = 1",
            "")]
    return []
