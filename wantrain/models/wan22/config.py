"""Config sections of the Wan 2.2 model family: ``[model]`` and ``[lora]`` (documented in docs/models.md).

Cross-key rules (an expert the variant lacks, a ``min_t`` outside the trained expert's range, a single-file key
for the wrong variant) are checked when the section is built, so a bad config fails at load time with one line.
Whether files exist is checked later, by :func:`wantrain.models.wan22.build_adapter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.errors import ConfigError
from wantrain.models.wan22.variants import VARIANTS


@section
class ModelConfig:
    """The Wan 2.2 model to train: variant, weights, experts, timestep sampling and memory options."""

    variant: str = setting(
        "tiny-t2v",
        doc="Model variant; the `tiny-*` twins are random toy models with the same structure (no weights needed).",
        choices=tuple(VARIANTS),
    )
    path: Path | None = setting(
        None,
        doc="Local diffusers-format model directory (`transformer/`, `transformer_2/`, `vae/`, `text_encoder/`, "
        "`tokenizer/`). Required for real variants; a tiny variant with a path loads it instead of random weights.",
    )
    high_noise_file: Path | None = setting(
        None, doc="Single-file (original Wan or ComfyUI keys) .safetensors of the A14B high-noise expert; "
        "replaces `transformer/`.",
    )
    low_noise_file: Path | None = setting(
        None, doc="Single-file .safetensors of the A14B low-noise expert; replaces `transformer_2/`.",
    )
    transformer_file: Path | None = setting(
        None, doc="Single-file .safetensors of the TI2V-5B transformer; replaces `transformer/`.",
    )
    experts: Literal["both", "high_noise", "low_noise"] = setting(
        "both", doc="A14B experts to train (single-transformer variants accept only `both`)."
    )
    switch_every: int = setting(
        10, doc="With `experts = \"both\"`, the trained expert alternates every N optimizer steps.",
        range=at_least(1),
    )
    lr_high_noise: float | None = setting(
        None, doc="Learning rate of the high-noise LoRA; unset uses `optimizer.lr`.", range=above(0.0)
    )
    lr_low_noise: float | None = setting(
        None, doc="Learning rate of the low-noise LoRA; unset uses `optimizer.lr`.", range=above(0.0)
    )
    timestep_sampling: Literal["uniform", "logit_normal", "sigmoid"] = setting(
        "logit_normal",
        doc="Distribution of t before the shift: uniform, sigmoid(N(logit_mean, logit_std)), or "
        "sigmoid(sigmoid_scale * N(0, 1)).",
    )
    logit_mean: float = setting(0.0, doc="Mean of the normal in `logit_normal` sampling.")
    logit_std: float = setting(1.0, doc="Standard deviation of the normal in `logit_normal` sampling.",
                               range=above(0.0))
    sigmoid_scale: float = setting(1.0, doc="Scale of the normal in `sigmoid` sampling.", range=above(0.0))
    shift: float = setting(1.0, doc="Timestep shift s: t' = s*t / (1 + (s-1)*t).", range=above(0.0))
    min_t: float | None = setting(
        None, doc="Lowest t trained (0-1 units, after the shift); must lie in the trained expert's range.",
        range=between(0.0, 1.0),
    )
    max_t: float | None = setting(
        None, doc="Highest t trained (0-1 units, after the shift); must lie in the trained expert's range.",
        range=between(0.0, 1.0),
    )
    i2v_probability: float = setting(
        0.5, doc="TI2V only: chance that a sample trains image-to-video (clean first latent frame, excluded "
        "from the loss) instead of text-to-video. Single-frame samples always train text-to-video.",
        range=between(0.0, 1.0),
    )
    gradient_checkpointing: bool = setting(True, doc="Recompute transformer activations in the backward pass.")
    base_dtype: Literal["auto", "fp32", "bf16", "fp8"] = setting(
        "auto",
        doc="Storage dtype of the frozen base transformer: `auto` is fp32 for tiny variants and bf16 for real "
        "ones; `fp8` stores float8_e4m3fn and computes in bf16 (CUDA only).",
    )
    offload_device: str = setting(
        "cpu", doc="Where the inactive expert and its optimizer state wait while the other one trains."
    )

    def __attrs_post_init__(self) -> None:
        spec = VARIANTS[self.variant]
        try:
            offload = torch.device(self.offload_device)
        except (RuntimeError, ValueError):
            offload = None
        if offload is None or offload.type == "meta":
            raise ConfigError(
                f"model.offload_device = {self.offload_device!r} is not a usable device; use 'cpu' or 'cuda:N'"
            )
        if spec.boundary_ratio is None:
            if self.experts != "both":
                raise ConfigError(
                    f"model.experts = {self.experts!r} is not valid for {self.variant}: it has one transformer; "
                    "leave model.experts at 'both'"
                )
            for key in ("high_noise_file", "low_noise_file", "lr_high_noise", "lr_low_noise"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"model.{key} applies to the two-expert A14B variants, not to {self.variant}")
        elif self.transformer_file is not None:
            raise ConfigError(
                f"model.transformer_file is for ti2v variants; for {self.variant} use model.high_noise_file / "
                "model.low_noise_file"
            )
        if self.min_t is not None and self.max_t is not None and self.min_t >= self.max_t:
            raise ConfigError(f"model.min_t = {self.min_t:g} must be below model.max_t = {self.max_t:g}")
        low, high = _trained_range(spec.boundary_ratio, self.experts)
        for key in ("min_t", "max_t"):
            value = getattr(self, key)
            if value is not None and not (low <= value <= high):
                raise ConfigError(
                    f"model.{key} = {value:g} lies outside the range of the trained expert(s) "
                    f"({self.experts}: {low:g}..{high:g}); use a value in that range"
                )
        if self.experts == "both" and spec.boundary_ratio is not None:
            b = spec.boundary_ratio
            if self.min_t is not None and self.min_t >= b:
                raise ConfigError(
                    f"model.min_t = {self.min_t:g} leaves the low-noise expert nothing to train (its range ends "
                    f"at the boundary {b:g}); with experts = 'both' min_t bounds the low-noise band"
                )
            if self.max_t is not None and self.max_t <= b:
                raise ConfigError(
                    f"model.max_t = {self.max_t:g} leaves the high-noise expert nothing to train (its range "
                    f"starts at the boundary {b:g}); with experts = 'both' max_t bounds the high-noise band"
                )

    @property
    def trained_experts(self) -> tuple[str | None, ...]:
        """The experts this config trains, in the fixed order high_noise, low_noise (or ``(None,)``)."""
        spec = VARIANTS[self.variant]
        if spec.boundary_ratio is None:
            return (None,)
        return spec.experts if self.experts == "both" else (self.experts,)


def _trained_range(boundary: float | None, experts: str) -> tuple[float, float]:
    if boundary is None or experts == "both":
        return 0.0, 1.0
    return (boundary, 1.0) if experts == "high_noise" else (0.0, boundary)


# -- [lora.alpha_schedule]: the progressive alpha controller (wantrain.observers.alpha.controller) -----------------

ALPHA_PRESETS: dict[str, dict[str, float | int | None]] = {
    # Flow-matching video losses vary 10-100x more between steps than image losses (the timestep draw and the
    # clip dominate), so the video preset looks over a longer window and tolerates ~11x the variance (CV 0.5 vs
    # 0.15) and a 5x larger trend before it calls the loss flat. R^2 is not checked by default: on noisy video
    # losses it is ~0.0004 whether or not the loss still falls (the seed's own finding).
    "video": {"window": 200, "min_samples": 100, "min_steps": 500, "loss_improvement_rate_below": 0.05,
              "min_gradient_stability": 0.50, "min_loss_r2": None, "max_loss_cv": 0.5},
    "image": {"window": 100, "min_samples": 50, "min_steps": 500, "loss_improvement_rate_below": 0.01,
              "min_gradient_stability": 0.50, "min_loss_r2": None, "max_loss_cv": 0.15},
}
"""Defaults per ``preset`` for every key a phase or the schedule leaves unset (docs/alpha_schedule.md)."""

CRITERIA = ("loss_improvement_rate_below", "min_gradient_stability", "min_loss_r2", "max_loss_cv")


@section
class ExitCriteria:
    """The seed's nested spelling of a phase's exit criteria (`[...phases.NAME.exit_criteria]`)."""

    loss_improvement_rate_below: float | None = setting(
        None, doc="The phase may end when |relative loss change per 100 steps| is below this.", range=above(0.0))
    min_gradient_stability: float | None = setting(
        None, doc="... and the gradient sign agreement is at least this.", range=between(0.0, 1.0))
    min_loss_r2: float | None = setting(None, doc="... and the loss trend's R^2 is at least this.",
                                        range=between(0.0, 1.0))
    max_loss_cv: float | None = setting(None, doc="... and the loss's coefficient of variation is at most this.",
                                        range=above(0.0))


@section
class AlphaPhase:
    """One phase of the alpha schedule: its alpha, its minimum length and the criteria that end it. Unset
    criteria come from the schedule's `preset`; the last phase never ends."""

    name: str = setting(doc="Phase name (shown in metrics, events and the progress line).")
    alpha: float = setting(doc="LoRA alpha during this phase (the LoRA output is scaled by alpha/rank).",
                           range=above(0.0))
    min_steps: int | None = setting(
        None, doc="Optimizer steps of the expert in this phase before it may end (unset: the preset's).",
        range=at_least(0))
    loss_improvement_rate_below: float | None = setting(
        None, doc="Exit when |relative loss change per 100 steps| < this (unset: the preset's).", range=above(0.0))
    min_gradient_stability: float | None = setting(
        None, doc="Exit needs gradient sign agreement >= this (unset: the preset's).", range=between(0.0, 1.0))
    min_loss_r2: float | None = setting(
        None, doc="Exit needs the loss trend's R^2 >= this (unset: the preset's; the presets do not check it).",
        range=between(0.0, 1.0))
    max_loss_cv: float | None = setting(
        None, doc="Exit needs the loss's coefficient of variation <= this (unset: the preset's).", range=above(0.0))
    exit_criteria: ExitCriteria | None = setting(
        None, doc="The seed's spelling: the four criteria in a nested table (keys given directly win).")

    def criterion(self, key: str, preset: str) -> float | None:
        """The threshold in force for ``key`` (a name in :data:`CRITERIA` or ``min_steps``)."""
        value = getattr(self, key)
        if value is None and key != "min_steps" and self.exit_criteria is not None:
            value = getattr(self.exit_criteria, key)
        return ALPHA_PRESETS[preset][key] if value is None else value


def _phases_from_table(table: dict, path: str) -> list[AlphaPhase]:
    """The seed's ``conv_alpha_phases = {name = {alpha, min_steps, exit_criteria}}`` as a phase list."""
    from wantrain.core.config import check_value

    phases = []
    for name, body in table.items():
        if not isinstance(body, dict):
            raise ConfigError(f"'{path}.{name}' must be a table with alpha, min_steps and exit_criteria")
        try:
            (phase,) = check_value(AlphaScheduleConfig, "phases", [{"name": name, **body}], f"{path}.{name}")
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(f"{path}.{name}[0]", f"{path}.{name}")) from None
        phases.append(phase)
    return phases


@section
class AlphaScheduleConfig:
    """Progressive alpha (seed 001): ordered phases with rising alpha, each expert moving on by itself when its
    exit criteria hold (docs/alpha_schedule.md)."""

    enabled: bool = setting(False, doc="Run the alpha controller. Off: no observer, no files, training unchanged.")
    preset: Literal["video", "image"] = setting(
        "video", doc="Defaults for the windows and the exit criteria: `video` tolerates far more loss variance.")
    targets: Literal["linear", "conv", "all"] = setting(
        "linear", doc="LoRA layers whose alpha the phases set. Wan 2.2's LoRA layers are all Linear, so `conv` "
        "is refused (it would change nothing, the seed's defect).")
    transition: Literal["preserve_output", "jump"] = setting(
        "preserve_output", doc="`preserve_output` rescales LoRA B and the optimizer moments so the model's output "
        "is unchanged at a transition; `jump` only changes alpha (the seed: the LoRA's output jumps by new/old).")
    window: int | None = setting(
        None, doc="Per-step losses and gradient-stability values per expert the statistics use (unset: preset).",
        range=at_least(3))
    min_samples: int | None = setting(
        None, doc="Finite losses an expert's window needs before its phase may end (unset: preset).",
        range=at_least(3))
    phases: list[AlphaPhase] = setting(
        factory=list, doc="The phases in order (`[[lora.alpha_schedule.phases]]`), at least two.")
    conv_alpha_phases: dict | None = setting(
        None, doc="The seed's spelling of `phases`: a table of phase name -> {alpha, min_steps, exit_criteria}, in "
        "order; read as `phases` (applied to `targets`, not only to conv layers).")
    linear_alpha: float | None = setting(
        None, doc="The seed's fixed alpha of Linear layers while conv layers phase; accepted so the seed's files "
        "load, and unused: wantrain phases the layers `targets` names.", range=above(0.0))

    def __attrs_post_init__(self) -> None:
        if self.conv_alpha_phases is not None:
            if self.phases:
                raise ConfigError("lora.alpha_schedule: give the phases once, as phases or as conv_alpha_phases")
            phases = _phases_from_table(self.conv_alpha_phases, "lora.alpha_schedule.conv_alpha_phases")
            object.__setattr__(self, "phases", phases)
            object.__setattr__(self, "conv_alpha_phases", None)
        if not self.enabled:
            return
        if self.targets == "conv":
            raise ConfigError(
                "lora.alpha_schedule.targets = 'conv': Wan 2.2's LoRA has no conv layers (its targets are the blocks' "
                "Linear layers), so the phases would change nothing; use 'linear' or 'all'"
            )
        if len(self.phases) < 2:
            raise ConfigError(
                f"lora.alpha_schedule has {len(self.phases)} phase(s); an enabled schedule needs at least two "
                "([[lora.alpha_schedule.phases]] tables with name and alpha)"
            )
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora.alpha_schedule.phases: phase names must differ, got {names}")
        if self.resolved("min_samples") > self.resolved("window"):
            raise ConfigError(
                f"lora.alpha_schedule.min_samples = {self.resolved('min_samples')} exceeds window = "
                f"{self.resolved('window')}; a phase could never end — lower min_samples or raise window"
            )

    def resolved(self, key: str) -> int:
        """``window`` or ``min_samples`` as set, else the preset's."""
        value = getattr(self, key)
        return int(ALPHA_PRESETS[self.preset][key] if value is None else value)


@section
class LoraConfig:
    """The LoRA adapters: one per trained expert on the 10 Linears of every block (see docs/models.md)."""

    rank: int = setting(16, doc="LoRA rank.", range=at_least(1))
    alpha: float | None = setting(
        None, doc="LoRA alpha; the LoRA output is scaled by alpha/rank. Unset means alpha = rank (scale 1).",
        range=above(0.0),
    )
    dropout: float = setting(0.0, doc="Dropout on the LoRA input during training.", range=between(0.0, 0.99))
    save_dtype: Literal["bf16", "fp32"] = setting("bf16", doc="dtype of the LoRA matrices in the saved files.")
    alpha_schedule: AlphaScheduleConfig | None = setting(
        None, doc="Progressive alpha phases (docs/alpha_schedule.md); absent or `enabled = false` changes nothing.")

    def __attrs_post_init__(self) -> None:
        schedule = self.alpha_schedule
        if self.schedule_enabled and self.alpha is not None and self.alpha != schedule.phases[0].alpha:
            raise ConfigError(
                f"lora.alpha = {self.alpha:g} conflicts with lora.alpha_schedule: its first phase "
                f"({schedule.phases[0].name!r}) sets alpha {schedule.phases[0].alpha:g} from the first step; remove "
                "lora.alpha or make the two equal"
            )

    @property
    def schedule_enabled(self) -> bool:
        return self.alpha_schedule is not None and self.alpha_schedule.enabled

    @property
    def effective_alpha(self) -> float:
        """The alpha the LoRA starts with: the first phase's when the alpha schedule is on."""
        if self.schedule_enabled:
            return float(self.alpha_schedule.phases[0].alpha)
        return float(self.rank) if self.alpha is None else float(self.alpha)

