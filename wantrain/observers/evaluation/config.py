"""Config sections ``[validation]`` (fixed-timestep validation loss) and ``[sample]`` (sample videos), read by
``wantrain/observers/evaluation/validation.py`` and ``samples.py``; see docs/validation.md.

Checks that need only the section happen here (one line naming the key); checks against the model variant (image
count, sizes) happen in :func:`check_sections`, which ``wantrain.app.assemble.prepare`` calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wantrain.core.config import at_least, between, section, setting
from wantrain.core.errors import ConfigError

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
        if not self.timesteps or any(not 0.0 < t < 1.0 for t in self.timesteps):
            raise ConfigError(f"config key 'validation.timesteps' = {self.timesteps!r}: give one or more timesteps "
                              "strictly between 0 and 1, for example [0.1, 0.3, 0.5, 0.7, 0.9]")
        if len(set(self.timesteps)) != len(self.timesteps):
            raise ConfigError(f"config key 'validation.timesteps' = {self.timesteps!r} repeats a timestep")
        if self.enabled and (self.path is None) == (self.from_training is None):
            raise ConfigError("[validation] is enabled: set exactly one of 'validation.path' (a folder of clips) "
                              "and 'validation.from_training' (a number of training clips)")


@section
class SampleConfig:
    """Sample videos generated during training with diffusers' Wan pipelines (docs/validation.md)."""

    enabled: bool = setting(False, doc="Generate sample videos at step 0, every `every` steps and at the end.")
    prompts: list[str] = setting(factory=list, doc="One video per prompt (`samples/step_000200_00.mp4`, ...).")
    images: list[Path] = setting(
        factory=list, doc="First-frame images, one per prompt: required for I2V, optional for TI2V (image-to-video "
        "when given), refused for T2V."
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
    negative_prompt: str = setting("", doc="Negative prompt used with guidance.")
    seed: int = setting(42, doc="Seed of each video's initial noise (video i uses seed + i).",
                        range=between(0, 2**63 - 1))
    fps: float | None = setting(None, doc="Frame rate written to the mp4 files; unset: the variant's.",
                                range=at_least(1.0))

    def __attrs_post_init__(self) -> None:
        if self.enabled and not self.prompts:
            raise ConfigError("[sample] is enabled but 'sample.prompts' is empty; give one or more prompts")
        if self.frames is not None and (self.frames - 1) % 4:
            raise ConfigError(f"config key 'sample.frames' = {self.frames}: use a count of the form 4k+1 "
                              "(1, 5, 9, ..., 81)")


def sample_size(cfg: SampleConfig, spec: Any) -> tuple[int, int, int]:
    """(width, height, frames) of the samples, unset values taken from the variant."""
    width, height = spec.default_resolution
    return cfg.width or width, cfg.height or height, cfg.frames or spec.default_frames


def check_sections(validation: ValidationConfig, sample: SampleConfig, spec: Any, experts: tuple) -> None:
    """Refusals that depend on the model variant; raises ConfigError with one line."""
    if validation.enabled:
        if validation.path is not None and not Path(validation.path).is_dir():
            raise ConfigError(f"config key 'validation.path' = '{validation.path}' is not a folder; give a folder "
                              "of clips with captions, or use 'validation.from_training'")
        if not any(expert_for_t(t, spec.boundary_ratio, experts) != "untrained" for t in validation.timesteps):
            raise ConfigError(f"config key 'validation.timesteps' = {validation.timesteps!r}: none falls in the band "
                              f"of a trained expert ({', '.join(str(e) for e in experts)}; the boundary is "
                              f"t = {spec.boundary_ratio})")
    if not sample.enabled:
        return
    width, height, _ = sample_size(sample, spec)
    multiple = spec.spatial_multiple
    for key, value in (("width", width), ("height", height)):
        if value % multiple:
            raise ConfigError(f"config key 'sample.{key}' = {value}: {spec.name} needs a multiple of {multiple}")
    if spec.conditioning == "t2v" and sample.images:
        raise ConfigError(f"config key 'sample.images' is set but {spec.name} is text-to-video; remove it")
    if spec.conditioning == "i2v" and len(sample.images) != len(sample.prompts):
        raise ConfigError(f"{spec.name} is image-to-video: 'sample.images' needs one first-frame image per prompt "
                          f"({len(sample.prompts)} prompts, {len(sample.images)} images)")
    if spec.conditioning == "ti2v" and sample.images and len(sample.images) != len(sample.prompts):
        raise ConfigError(f"config key 'sample.images': give one image per prompt ({len(sample.prompts)}) or none "
                          f"(text-to-video), not {len(sample.images)}")
    for i, image in enumerate(sample.images):
        if not Path(image).is_file():
            raise ConfigError(f"config key 'sample.images[{i}]' = '{image}' does not exist (an image file)")
        _check_image(f"sample.images[{i}]", Path(image))
    if experts != tuple(spec.experts) and spec.boundary_ratio is not None:
        raise ConfigError(f"[sample] needs both experts of {spec.name} (sampling runs the high- and the low-noise "
                          "expert); set model.experts = 'both' or disable [sample]")


def expert_for_t(t: float, boundary: float | None, experts: tuple) -> str | None:
    """The expert that owns ``t`` (high noise t >= boundary), or ``"untrained"`` when it is not trained."""
    if boundary is None:
        return experts[0]
    owner = "high_noise" if t >= boundary else "low_noise"
    return owner if owner in experts else "untrained"


def _check_image(key: str, path: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ConfigError(f"config key '{key}' = '{path}' is not a readable image ({exc})") from None
