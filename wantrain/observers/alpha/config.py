"""``[lora.alpha_schedule]``: the progressive alpha controller's config (``wantrain.observers.alpha.controller``;
docs/alpha_schedule.md). The root schema (``wantrain.app.config``) puts it in the ``[lora]`` table."""

from __future__ import annotations

from typing import Any, Literal

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.errors import ConfigError
from wantrain.core.problems import Problem, Rule, bad_value, refuse

ALPHA_PRESETS: dict[str, dict[str, float | int | None]] = {
    # Derived in docs/alpha_schedule.md ("Presets"): a LoRA's loss still falls ~0.5-1 % per 100 steps well into a
    # run, so delta = 0.005; video's per-step CV is 0.3-0.5 with AR(1)-like correlation between steps (rho ~0.5,
    # which triples the slope's variance). A window of n steps gives the improvement rate a standard error of
    # 100·CV·sqrt(12/n^3)·sqrt((1+rho)/(1-rho)): 0.0012 per 100 steps for n = 4000 at CV 0.5, rho 0.5, so a flat
    # loss ends >= 95 % of phases within two looks (delta >= the smallest resolvable slope, 0.0043) and a 1 % rise
    # is 8 se below zero. The image preset: the same at CV 0.15 needs 1800 steps.
    # R^2 and CV are logged but not checked unless a phase sets them (on noisy video losses R^2 is ~0.0004 whether
    # or not the loss still falls: the seed's own finding).
    "video": {"window": 4000, "min_samples": 3000, "min_steps": 4000, "loss_improvement_rate_below": 0.005,
              "min_gradient_stability": 0.50, "min_loss_r2": None, "max_loss_cv": None},
    "image": {"window": 1800, "min_samples": 1350, "min_steps": 1800, "loss_improvement_rate_below": 0.005,
              "min_gradient_stability": 0.50, "min_loss_r2": None, "max_loss_cv": None},
}
"""Defaults per ``preset`` for every key a phase or the schedule leaves unset (docs/alpha_schedule.md)."""

def stability_applicable(experts: tuple[str | None, ...], switch_every: int, expert_groups: int = 1) -> bool:
    """Whether gradient stability has samples: with two experts alternating every step, every stint of an expert
    is one step, with no previous step of its own to compare with (``min_gradient_stability`` is not applied then,
    with a warning when the config is read). With ``model.expert_groups`` > 1 nothing alternates: each group
    trains its expert at every step."""
    return not (len(experts) > 1 and switch_every == 1 and expert_groups <= 1)


CRITERIA = ("loss_improvement_rate_below", "min_gradient_stability", "min_loss_r2", "max_loss_cv")


@section
class ExitCriteria:
    """The seed's nested spelling of a phase's exit criteria (`[...phases.NAME.exit_criteria]`)."""

    loss_improvement_rate_below: float | None = setting(
        None, doc="The phase may end when the loss no longer falls this share per 100 expert steps (one-sided).",
        range=above(0.0))
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
        None, doc="Exit when the loss, with confidence, no longer falls this share of itself per 100 expert steps "
        "(and is not rising; unset: the preset's).", range=above(0.0))
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
        """The threshold in force for ``key`` (a name in :data:`CRITERIA` or ``min_steps``). The seed's nested
        ``exit_criteria.min_loss_r2`` is advisory, as it was in the seed (its own review made R² advisory): R² is
        checked only when ``min_loss_r2`` is set on the phase itself."""
        value = getattr(self, key)
        if value is None and key not in ("min_steps", "min_loss_r2") and self.exit_criteria is not None:
            value = getattr(self.exit_criteria, key)
        return ALPHA_PRESETS[preset][key] if value is None else value


def _phases_from_table(table: dict, path: str) -> tuple[list[AlphaPhase], list[Problem]]:
    """The seed's ``conv_alpha_phases = {name = {alpha, min_steps, exit_criteria}}`` as a phase list, and the
    problems of the phases that could not be read."""
    from wantrain.core.config import check_value

    phases, found = [], []
    for name, body in table.items():
        if not isinstance(body, dict):
            found.append(bad_value(f"{path}.{name}", f"'{path}.{name}' must be a table with alpha, min_steps and "
                                   "exit_criteria"))
            continue
        try:
            (phase,) = check_value(AlphaScheduleConfig, "phases", [{"name": name, **body}], f"{path}.{name}")
        except ConfigError as exc:  # the phase's own keys, read as [[phases]] are
            found.append(bad_value(f"{path}.{name}", str(exc).replace(f"{path}.{name}[0]", f"{path}.{name}")))
            continue
        phases.append(phase)
    return phases, found


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
        None, doc="Per-step losses and gradient-stability values per expert the statistics use, and the expert "
        "steps between two looks of the plateau test, so that the looks' windows are disjoint (unset: preset).",
        range=at_least(3))
    min_samples: int | None = setting(
        None, doc="Finite losses an expert's window needs before its phase may end (unset: preset).",
        range=at_least(3))
    signal: Literal["train", "validation"] = setting(
        "train", doc="What shows the plateau: `train` tests the per-step training loss's trend against its noise "
        "on disjoint windows (window statistics); `validation` reads the fixed-timestep validation loss "
        "(`val/loss/<expert>`, or `val/loss` for one transformer; needs [validation] enabled): a phase may end once "
        "the decrease between consecutive validations, per 100 expert steps, stays below "
        "`loss_improvement_rate_below` on `validation_patience` validations in a row and the loss did not rise "
        "faster than that over them.")
    validation_patience: int = setting(
        3, doc="With `signal = \"validation\"`: consecutive validation intervals in the phase whose relative "
        "decrease per 100 expert steps must lie below `loss_improvement_rate_below`.", range=at_least(1))
    phases: list[AlphaPhase] = setting(
        factory=list, doc="The phases in order (`[[lora.alpha_schedule.phases]]`), at least two.")
    conv_alpha_phases: dict | None = setting(
        None, doc="The seed's spelling of `phases`: a table of phase name -> {alpha, min_steps, exit_criteria}, in "
        "order; read as `phases` (applied to `targets`, not only to conv layers).")
    linear_alpha: float | None = setting(
        None, doc="The seed's fixed alpha of Linear layers while conv layers phase; accepted so the seed's files "
        "load, and unused: wantrain phases the layers `targets` names.", range=above(0.0))

    def __attrs_post_init__(self) -> None:
        """The seed's ``conv_alpha_phases`` read as ``phases``, then every problem of an enabled schedule
        (``core.problems.refuse``: collected by the loader, raised in code)."""
        key = "lora.alpha_schedule"
        if self.conv_alpha_phases is not None:
            if self.phases:
                refuse([bad_value(f"{key}.conv_alpha_phases", f"{key}: give the phases once, as phases or as "
                                  "conv_alpha_phases")])
                return
            phases, unread = _phases_from_table(self.conv_alpha_phases, f"{key}.conv_alpha_phases")
            if unread:
                refuse(unread)
                return
            object.__setattr__(self, "phases", phases)
            object.__setattr__(self, "conv_alpha_phases", None)
        if not self.enabled:
            return
        found = []
        if self.targets == "conv":
            found.append(bad_value(f"{key}.targets", f"{key}.targets = 'conv': Wan 2.2's LoRA has no conv layers (its "
                                   "targets are the blocks' Linear layers), so the phases would change nothing; use "
                                   "'linear' or 'all'"))
        if len(self.phases) < 2:
            found.append(bad_value(f"{key}.phases", f"{key} has {len(self.phases)} phase(s); an enabled schedule "
                                   "needs at least two ([[lora.alpha_schedule.phases]] tables with name and alpha)"))
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            found.append(bad_value(f"{key}.phases", f"{key}.phases: phase names must differ, got {names}"))
        if self.resolved("min_samples") > self.resolved("window"):
            found.append(bad_value(f"{key}.min_samples", f"{key}.min_samples = {self.resolved('min_samples')} "
                                   f"exceeds window = {self.resolved('window')}; a phase could never end — lower "
                                   "min_samples or raise window"))
        refuse(found)

    def resolved(self, key: str) -> int:
        """``window`` or ``min_samples`` as set, else the preset's."""
        value = getattr(self, key)
        return int(ALPHA_PRESETS[self.preset][key] if value is None else value)


ALPHA_RULES = (
    ALPHA_VS_FIRST_PHASE := Rule("alpha-vs-first-phase", ("lora.alpha", "lora.alpha_schedule"),
                                 "lora.alpha unlike the schedule's first phase"),
    VALIDATION_SIGNAL := Rule("validation-signal", ("lora.alpha_schedule.signal", "validation.enabled",
                                                    "validation.timesteps", "model.experts"),
                              "signal = 'validation' without a validation loss of every trained expert",
                              ("lora.alpha_schedule (signal = validation)", "validation.enabled = false")),
)


def alpha_schedule_problems(cfg: Any) -> list[Problem]:
    """An enabled ``[lora.alpha_schedule]`` against the rest of the run config ``cfg``: its first phase sets the
    alpha, and a validation signal needs validation losses of every trained expert. (With ``model.expert_groups``
    every rank decides for every group's expert from the reduced metrics: ``observers.alpha.controller``.)"""
    if not cfg.lora.schedule_enabled:
        return []
    schedule, out = cfg.lora.alpha_schedule, []
    first = schedule.phases[0]
    if cfg.lora.alpha is not None and cfg.lora.alpha != first.alpha:
        out.append(ALPHA_VS_FIRST_PHASE.problem(
            f"lora.alpha = {cfg.lora.alpha:g} conflicts with lora.alpha_schedule: its first phase ({first.name!r}) "
            f"sets alpha {first.alpha:g} from the first step; remove lora.alpha or make the two equal"))
    if schedule.signal == "validation":
        out.extend(_validation_signal_problems(cfg))
    return out


def _validation_signal_problems(cfg: Any) -> list[Problem]:
    if not cfg.validation.enabled:
        return [VALIDATION_SIGNAL.problem(
            "lora.alpha_schedule.signal = 'validation' needs the validation loss, but [validation] is not enabled; "
            "set validation.enabled = true (with validation.path or validation.from_training) or use signal = 'train'")]
    boundary = cfg.model.boundary_ratio
    if boundary is None:
        return []
    owned = {"high_noise" if t >= boundary else "low_noise" for t in cfg.validation.timesteps}
    missing = [e for e in cfg.model.trained_experts if e not in owned]
    if not missing:
        return []
    return [VALIDATION_SIGNAL.problem(
        f"lora.alpha_schedule.signal = 'validation': validation.timesteps = {list(cfg.validation.timesteps)} has no "
        f"timestep of the {missing[0]} expert (high_noise owns t >= {boundary:g}), so its phase could never end; add "
        "one to validation.timesteps")]
