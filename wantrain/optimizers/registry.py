"""The optimizer types users know from the peer trainers, each backed by its maintained library class.

A :class:`OptimizerType` says which class a ``type`` builds, which package provides it, which of the table's common
keys (``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``) it reads and their defaults, the keyword arguments
wantrain sets or owns, and how the run treats it: whether the core's non-finite guard can skip a step on the device
(the GradScaler ``found_inf`` protocol), which parameter-group keys are optimizer *state* rather than
hyperparameters (restored from a checkpoint instead of the config), whether it has ``train()``/``eval()`` modes, and
whether it adapts its own step size (logged as ``optimizer/effective_lr/<group>``).
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from wantrain.core.problems import Problem, Rule

COMMON_KEYS = ("lr", "weight_decay", "beta1", "beta2", "eps")
_ADAM_DEFAULTS = {"lr": 1e-4, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


@attrs.frozen
class OptimizerType:
    name: str
    class_path: str
    package: str | None  # pip name when not in the base install
    defaults: dict[str, Any]  # common key -> default; a common key missing here does not apply to the type
    fixed: dict[str, Any] = attrs.field(factory=dict)  # keyword arguments wantrain sets (a user key may override)
    refused: dict[str, str] = attrs.field(factory=dict)  # keyword argument -> why it cannot be set
    refused_values: dict[str, tuple[Any, str]] = attrs.field(factory=dict)  # argument -> (bad value, why)
    group_state_keys: tuple[str, ...] = ()
    modes: bool = False  # train()/eval(): eval-mode weights are the ones saved
    adaptive_lr: str | None = None  # parameter-group key of the optimizer's own step-size estimate
    # with adaptive_lr, lr multiplies the estimate: the accepted multipliers around the documented one (inclusive)
    lr_range: tuple[float, float] | None = None
    # without adaptive_lr, lr is the step size itself: above this no LoRA trains (every weight moves by about lr
    # per step; LoRA learning rates are about 1e-5 to 1e-3), so a larger one is a typo or another optimizer's value
    lr_max: float | None = None
    state_kind: str | None = None  # how its state follows an alpha rescale (wantrain.core.optim_state); None: no map
    summary: str = ""
    shown: str = ""  # how messages name the class (the library's, where wantrain subclasses it)

    @property
    def label(self) -> str:
        return f"{self.shown or self.class_path} (type {self.name!r})"

    def load_class(self) -> type:
        module, _, name = self.class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)


# Arguments no type may take from the config: wantrain passes them, or they mean something the run does not do.
RESERVED = {
    "params": "wantrain passes the LoRA parameter groups",
    "betas": "write beta1 and beta2",
}

TYPES: dict[str, OptimizerType] = {
    t.name: t
    for t in (
        OptimizerType(
            "adamw", "torch.optim.AdamW", None, dict(_ADAM_DEFAULTS),
            refused={"differentiable": "wantrain does not differentiate through the optimizer step"},
            state_kind="adam", summary="torch's AdamW; fused kernel on CPU and CUDA (the default)", lr_max=1.0,
        ),
        OptimizerType(
            "adamw8bit", "bitsandbytes.optim.AdamW8bit", "bitsandbytes", dict(_ADAM_DEFAULTS),
            refused={"args": "set the keyword arguments directly", "optim_bits": "use type = 'adamw' for 32-bit"},
            state_kind="adam8bit", summary="AdamW with 8-bit block-wise quantized moments (bitsandbytes)",
            lr_max=1.0,
        ),
        OptimizerType(
            "prodigy", "wantrain.optimizers.prodigy.ExpertProdigy", "prodigyopt", {**_ADAM_DEFAULTS, "lr": 1.0},
            refused={"fsdp_in_use": "wantrain does not train with FSDP"},
            group_state_keys=("d", "d_max", "d_numerator", "d_denom", "d_hat", "k"),
            adaptive_lr="d", shown="prodigyopt.Prodigy", lr_range=(0.1, 10.0),
            summary="Prodigy: estimates the step size d itself; lr is a multiplier (keep 1.0)",
        ),
        OptimizerType(
            "adafactor", "transformers.optimization.Adafactor", None,
            {"lr": 1e-4, "weight_decay": 0.0, "beta1": None},
            fixed={"relative_step": False, "scale_parameter": False, "warmup_init": False},
            refused={"eps": "Adafactor's eps is a pair of regularisation constants; it keeps its defaults"},
            refused_values={"relative_step": (True, "the LR schedule ([lr_scheduler]) owns the learning rate; "
                                              "Adafactor's relative step would ignore it")},
            state_kind="adafactor", lr_max=1.0,
            summary="Adafactor: factored second moments (row and column sums), no first moment by default",
        ),
        OptimizerType(
            "adamw_schedulefree", "schedulefree.AdamWScheduleFree", "schedulefree", dict(_ADAM_DEFAULTS),
            group_state_keys=("k", "train_mode", "weight_sum", "lr_max", "scheduled_lr"),
            modes=True, state_kind="schedulefree", lr_max=1.0,
            summary="schedule-free AdamW: iterate averaging instead of a decaying schedule",
        ),
    )
}
EXTERNAL = "external"
TYPE_NAMES = (*TYPES, EXTERNAL)
INSTALL_HINT = "pip install 'wantrain[optimizers]'"


def resolve_type_class(spec: OptimizerType) -> type:
    """The library class of ``spec``; ImportError names the missing package."""
    try:
        return spec.load_class()
    except ImportError as exc:
        raise ImportError(
            f"optimizer.type = {spec.name!r} needs the Python package {spec.package or spec.class_path.split('.')[0]}"
            f", which cannot be imported ({exc}); {INSTALL_HINT}"
        ) from None


def check_lr_multiplier(type_name: str, key: str, value: float | None) -> None:
    """An adaptive optimizer's ``lr`` multiplies its own step-size estimate (Prodigy: ``d``, documented lr 1.0): a
    value far from that -- an AdamW learning rate such as 2e-3 left in the config -- makes the effective LR ~1000x
    smaller and the LoRA trains nothing, without a word. Refused (ValueError: the config layer words it). A plain
    optimizer's lr is the step size itself: one above its ``lr_max`` (AdamW at lr = 50) is refused too."""
    spec = TYPES.get(type_name)
    if value is None or spec is None:
        return
    if spec.lr_max is not None and value > spec.lr_max:
        raise ValueError(
            f"{key} = {value:g} with optimizer.type = {type_name!r} is no learning rate a LoRA trains with: "
            f"{spec.shown or spec.class_path} moves every weight by about lr per step, so anything above "
            f"{spec.lr_max:g} diverges at once; LoRA learning rates are about 1e-5 to 1e-3 (type = 'prodigy' is the "
            "one whose lr is a multiplier near 1)"
        )
    if spec.lr_range is None:
        return
    low, high = spec.lr_range
    if not low <= value <= high:
        default = spec.defaults["lr"]
        ratio = f"{default / value:.0f}x smaller" if value < default else f"{value / default:.0f}x larger"
        raise ValueError(
            f"{key} = {value:g} with optimizer.type = {type_name!r}: {spec.shown or spec.class_path}'s lr multiplies "
            f"the step size it estimates itself (documented value {default:g}; accepted {low:g} to {high:g}), so "
            f"{value:g} would make the effective LR {ratio} than it chooses; remove {key} or set it within "
            f"{low:g} to {high:g}"
        )


OPTIMIZER_RULES = (
    EXPERT_LR := Rule("expert-lr-multiplier", ("model.lr_high_noise", "model.lr_low_noise", "optimizer.type"),
                      "a per-expert LR that the optimizer type refuses (as optimizer.lr)"),
    PRESERVE_OUTPUT := Rule("preserve-output-optimizer-state",
                            ("lora.alpha_schedule.transition", "optimizer.type", "optimizer.class"),
                            "an optimizer whose state an alpha change cannot carry",
                            ("lora.alpha_schedule (preserve_output)", "optimizer.type = prodigy / unmapped")),
    LR_FINDER_ADAPTIVE := Rule("lr-finder-adaptive-optimizer", ("lr_finder.enabled", "optimizer.type"),
                               "the LR finder with an optimizer that sets its own step size",
                               ("LR finder", "optimizer.type = prodigy")),
)


def optimizer_problems(cfg: Any) -> list[Problem]:
    """The optimizer against the rest of the run config ``cfg``: the per-expert learning rates (they multiply an
    adaptive optimizer's estimate too), and an alpha schedule's ``preserve_output`` transition, which rescales the
    optimizer's moments and so needs a state it knows (``core.optim_state.STATE_MAPS``); the LR finder sweeps a
    learning rate, which an adaptive optimizer's ``lr`` (a multiplier of its own estimate) is not."""
    out = []
    for key in ("lr_high_noise", "lr_low_noise"):
        try:
            check_lr_multiplier(cfg.optimizer.type, f"model.{key}", getattr(cfg.model, key))
        except ValueError as exc:
            out.append(EXPERT_LR.problem(str(exc), keys=(f"model.{key}", "optimizer.type")))
    spec = TYPES.get(cfg.optimizer.type)
    if cfg.lr_finder.active and spec is not None and spec.adaptive_lr:  # its lr is no step size to sweep
        out.append(LR_FINDER_ADAPTIVE.problem(
            f"the LR finder sweeps the learning rate, but optimizer.type = {cfg.optimizer.type!r} estimates its own "
            "step size (its lr is a multiplier); run the finder with optimizer.type = 'adamw', or train without it",
            ""))
    schedule = cfg.lora.alpha_schedule
    if cfg.lora.schedule_enabled and schedule.transition == "preserve_output":
        from wantrain.core.optim_state import STATE_MAPS

        if cfg.optimizer.type == EXTERNAL:
            import torch

            cls = cfg.optimizer.optimizer_class()
            known = issubclass(cls, torch.optim.Adam | torch.optim.AdamW | torch.optim.SGD)
            what = f"optimizer.class = {cfg.optimizer.class_path!r}"
        else:
            known = TYPES[cfg.optimizer.type].state_kind in STATE_MAPS
            what = f"optimizer.type = {cfg.optimizer.type!r}"
        if not known:
            why = (" (Prodigy's step size d is one estimate over A and B together)" if cfg.optimizer.type == "prodigy"
                   else "")
            mapped = ", ".join(name for name, spec in TYPES.items() if spec.state_kind in STATE_MAPS)
            out.append(PRESERVE_OUTPUT.problem(
                f"lora.alpha_schedule.transition = 'preserve_output' cannot carry the state of {what} across an "
                f"alpha change{why}; use transition = 'jump' or optimizer.type = one of {mapped}"))
    return out
