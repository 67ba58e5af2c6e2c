"""Config section ``[lr_scheduler]`` (the seed's ``[lr_scheduler_config]`` is accepted by the root schema).

Everything a user can get wrong here is caught when the config is loaded, with one line naming the key:
an unknown type or key (did-you-mean), a key that belongs to another type, an ambiguous ``warmup_steps``,
and, for ``type = "external"``, a class outside the allowed modules (refused from the dotted string, before
anything is imported), a class that is not a scheduler, or arguments its constructor does not take.

Type-specific keys default to unset so that a key given for the wrong type is reported instead of silently
ignored; the defaults they take when unset are in :data:`DEFAULTS` and in each key's doc.
"""

from __future__ import annotations

import difflib
from typing import Any

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.errors import ConfigError
from wantrain.core.problems import Problem, bad_value, refuse

# Errors name keys by the canonical table; the seed's [lr_scheduler_config] is the same table.
TABLE = "lr_scheduler"

BUILTIN_TYPES = ("constant", "linear", "cosine", "cosine_annealing_warm_restarts_decay")
TYPES = (*BUILTIN_TYPES, "external")

# Keys that only some types read (besides the common `type`, `warmup_steps`, `warmup_start_factor`).
TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "linear": ("start_factor", "end_factor", "total_iters"),
    "cosine": ("eta_min",),
    "cosine_annealing_warm_restarts_decay": ("T_0", "T_mult", "eta_min", "gamma", "cycle_limit"),
    "external": ("class_path", "allow_external_code"),
}
COMMON_KEYS = ("type", "warmup_steps", "warmup_start_factor")
# Declared keys that are also constructor arguments of common scheduler classes; with type = "external" they
# are passed to the class like any other key of the table (the seed's StepLR example sets `gamma`).
PASS_THROUGH_KEYS = ("T_0", "T_mult", "eta_min", "gamma", "cycle_limit", "start_factor", "end_factor", "total_iters")

DEFAULTS: dict[str, Any] = {
    "warmup_start_factor": 0.0,
    "T_mult": 1,
    "eta_min": 0.0,
    "gamma": 1.0,
    "cycle_limit": None,
    "start_factor": 1.0,
    "end_factor": 0.0,
    "total_iters": None,
}

# Seed types that are not built in, and how to write them instead.
_SEED_TYPE_HINTS = {
    "exponential": "use type = 'external' with class = 'torch.optim.lr_scheduler.ExponentialLR' and gamma",
    "step": "use type = 'external' with class = 'torch.optim.lr_scheduler.StepLR', step_size and gamma",
    "sequential": "warmup is built in (warmup_steps); for the main schedule pick one of the built-in types",
    "cosine_annealing_warm_restarts": "use type = 'cosine_annealing_warm_restarts_decay' (gamma defaults to 1)",
    "constant_with_warmup": "use type = 'constant' with warmup_steps",
}


@section
class SchedulerConfig:
    """Learning-rate schedule over optimizer steps (docs/schedulers.md). Built-in types are closed-form
    functions of the optimizer step, so resuming is exact; `type = "external"` builds an allowed scheduler class
    with the other keys of the table as its arguments."""

    __wantrain_extra__ = "extra"

    type: str = setting(
        "constant",
        doc="Schedule type: `constant`, `linear`, `cosine`, `cosine_annealing_warm_restarts_decay` or `external`.",
    )
    warmup_steps: int | float = setting(
        0,
        doc="Linear warmup before the schedule: an integer is a number of optimizer steps (fewer than "
        "`train.max_steps`), a number strictly between 0 and 1 a fraction of the run (`0.05` = 5 %, rounded to the "
        "nearest step, at least 1 and at most `train.max_steps - 1`, so it fits a run of any length); `1.0` and "
        "other non-integral numbers >= 1 are rejected as ambiguous. The schedule itself runs over the steps that "
        "remain (>= 1).",
    )
    warmup_start_factor: float | None = setting(
        None,
        doc="LR of the first warmup step as a fraction of the peak (default 0: the ramp starts from 0 and reaches "
        "the peak at step `warmup_steps`).",
        range=between(0.0, 1.0),
    )
    T_0: int | None = setting(
        None, doc="`cosine_annealing_warm_restarts_decay`: optimizer steps of the first cycle (required).",
        range=at_least(1),
    )
    T_mult: int | float | None = setting(
        None,
        doc="`cosine_annealing_warm_restarts_decay`: each cycle is T_mult times longer than the previous one "
        "(>= 1, default 1; fractional values allowed; lengths are rounded to whole steps).",
    )
    eta_min: float | None = setting(
        None,
        doc="`cosine`, `cosine_annealing_warm_restarts_decay`: the LR the cosine decays towards (absolute, default 0); "
        "it never exceeds a cycle's decayed peak.",
        range=at_least(0.0),
    )
    gamma: float | None = setting(
        None,
        doc="`cosine_annealing_warm_restarts_decay`: the peak of cycle k is the base LR times gamma**k "
        "(in (0, 1], default 1).",
        range=above(0.0),
    )
    cycle_limit: int | None = setting(
        None,
        doc="`cosine_annealing_warm_restarts_decay`: number of cycles; after the last one the LR stays at its floor "
        "(default: unlimited).",
        range=at_least(1),
    )
    start_factor: float | None = setting(
        None, doc="`linear`: LR at the start of the schedule as a fraction of the base LR (default 1).",
        range=at_least(0.0),
    )
    end_factor: float | None = setting(
        None, doc="`linear`: LR at the end as a fraction of the base LR (default 0).", range=at_least(0.0)
    )
    total_iters: int | None = setting(
        None,
        doc="`linear`: optimizer steps the linear ramp takes, after which the LR stays at end_factor "
        "(default: all steps after warmup).",
        range=at_least(1),
    )
    class_path: str | None = setting(
        None,
        doc="`external`: dotted path of the scheduler class, e.g. `torch.optim.lr_scheduler.StepLR`; classes under "
        "torch.optim.lr_scheduler, timm.scheduler and transformers.optimization are allowed, other modules only with "
        "`--allow-code` on the command line.",
        aliases=("class",),
    )
    allow_external_code: bool = setting(
        False, doc="Accepted for older configs; grants nothing: a config cannot allow code itself (`--allow-code` "
        "does)."
    )
    extra: dict[str, Any] = setting(
        factory=dict, doc="Arguments of an external scheduler class (the table's other keys)."
    )

    def __attrs_post_init__(self) -> None:
        """Every problem of the section (``core.problems.refuse``: collected by the loader, raised in code)."""
        refuse(_validate(self))

    def get(self, name: str) -> Any:
        """The value of a type-specific key, or its default when unset."""
        value = getattr(self, name)
        return DEFAULTS.get(name) if value is None else value

    def external_arguments(self) -> dict[str, Any]:
        """Constructor arguments of an external class: the declared pass-through keys that are set, then extras."""
        args = {k: getattr(self, k) for k in PASS_THROUGH_KEYS if getattr(self, k) is not None}
        args.update(self.extra)
        return args


def _key_name(field: str) -> str:
    return "class" if field == "class_path" else field


def _types_reading(field: str) -> list[str]:
    return [t for t, keys in TYPE_KEYS.items() if field in keys]


def _validate(cfg: SchedulerConfig) -> list[Problem]:
    """Every problem of the section (a type that does not exist: that one alone, the others depend on it)."""
    if cfg.type not in TYPES:
        hint = _SEED_TYPE_HINTS.get(cfg.type)
        if hint is None:
            close = difflib.get_close_matches(cfg.type, TYPES, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "valid types: " + ", ".join(TYPES)
        return [bad_value(f"{TABLE}.type", f"{TABLE}.type = {cfg.type!r} is not a schedule type; {hint}")]
    found = _warmup_problems(cfg)
    if cfg.type == "external":
        return found + _external_problems(cfg)
    allowed = set(COMMON_KEYS) | set(TYPE_KEYS[cfg.type])
    for field in (*PASS_THROUGH_KEYS, "class_path"):
        if getattr(cfg, field) is not None and field not in allowed:
            where = " or ".join(repr(t) for t in _types_reading(field))
            found.append(bad_value(f"{TABLE}.{_key_name(field)}", f"{TABLE}.{_key_name(field)} does not apply to "
                                   f"type {cfg.type!r}; it is a key of type {where}"))
    if cfg.allow_external_code:
        found.append(bad_value(f"{TABLE}.allow_external_code",
                               f"{TABLE}.allow_external_code applies only to type = 'external'"))
    for key in cfg.extra:
        valid = [_key_name(k) for k in (*COMMON_KEYS, *TYPE_KEYS[cfg.type])]
        close = difflib.get_close_matches(key, valid + [_key_name(k) for k in PASS_THROUGH_KEYS], n=1, cutoff=0.6)
        if close:
            hint = f"did you mean '{TABLE}.{close[0]}'?"
        else:
            hint = (
                f"valid keys for type {cfg.type!r}: {', '.join(valid)} (arguments of a scheduler class need "
                "type = 'external' and class = '...')"
            )
        found.append(bad_value(f"{TABLE}.{key}", f"unknown config key '{TABLE}.{key}' for type {cfg.type!r}: {hint}"))
    if cfg.type == "cosine_annealing_warm_restarts_decay":
        if cfg.T_mult is not None and cfg.T_mult < 1:
            found.append(bad_value(f"{TABLE}.T_mult", f"{TABLE}.T_mult = {cfg.T_mult!r} is out of range; expected "
                                   ">= 1 (cycles never shrink)"))
        if cfg.T_0 is None:
            found.append(bad_value(f"{TABLE}.T_0", f"{TABLE}.T_0 is required for type "
                                   "'cosine_annealing_warm_restarts_decay' (optimizer steps of the first cycle, e.g. "
                                   "T_0 = 1000)"))
        if cfg.gamma is not None and cfg.gamma > 1.0:
            found.append(bad_value(f"{TABLE}.gamma", f"{TABLE}.gamma = {cfg.gamma!r} is out of range; expected > 0 "
                                   "and <= 1 (the peak of cycle k is base * gamma**k)"))
    return found


def _warmup_problems(cfg: SchedulerConfig) -> list[Problem]:
    w = cfg.warmup_steps
    key = f"{TABLE}.warmup_steps"
    if w < 0:
        return [bad_value(key, f"{TABLE}.warmup_steps = {w!r} is out of range; expected >= 0")]
    if isinstance(w, float) and w != 0.0 and not (0.0 < w < 1.0):
        if w.is_integer():
            example = f"warmup_steps = {int(w)}"
        else:
            example = "warmup_steps = 100"
        return [bad_value(key, f"{TABLE}.warmup_steps = {w!r} is ambiguous; write an integer for a number of "
                               f"optimizer steps ({example}) or a number between 0 and 1 for a fraction of the run "
                               "(warmup_steps = 0.05)")]
    if cfg.type == "external" and (w != 0 or cfg.warmup_start_factor is not None):
        return [bad_value(key, f"{TABLE}.warmup_steps is not supported with type = 'external'; use the class's own "
                               "warmup arguments or a built-in type")]
    return []


def _external_problems(cfg: SchedulerConfig) -> list[Problem]:
    from wantrain.schedulers.external import check_external

    if cfg.class_path is None:
        return [bad_value(f"{TABLE}.class", f"{TABLE}.class is required when type = 'external' (for example class = "
                                            "'torch.optim.lr_scheduler.StepLR')")]
    try:
        check_external(cfg.class_path, cfg.external_arguments(), allow_external_code=cfg.allow_external_code)
    except ConfigError as exc:  # the class, its module's trust and its arguments (schedulers.external)
        return [bad_value(f"{TABLE}.class", str(exc))]
    return []


def _fraction_of_run(fraction: float, total_steps: int) -> int:
    """A fractional warmup in steps: the nearest step (halves up), at least 1 and at most ``total_steps - 1``, so
    the schedule keeps at least one step and a fraction fits a run of any length (a one-step run has no warmup)."""
    if fraction == 0.0:
        return 0
    return min(max(1, int(fraction * total_steps + 0.5)), total_steps - 1)


def warmup_steps_for(cfg: SchedulerConfig, total_steps: int) -> int:
    """Warmup length in optimizer steps for a run of ``total_steps >= 1``: an integer as given, a fraction of the run
    as :func:`_fraction_of_run` rounds it. Raises ``ConfigError`` when an integer leaves no step for the schedule,
    suggesting an integer and a fraction that fit."""
    w = cfg.warmup_steps
    if isinstance(w, float):
        return _fraction_of_run(w, total_steps)
    if w and w >= total_steps:
        example = _fraction_of_run(0.05, total_steps)
        fits = (
            "use warmup_steps = 0" if total_steps == 1
            else f"use fewer than {total_steps} steps (warmup_steps = {example}, for example)"
        )
        raise ConfigError(
            f"{TABLE}.warmup_steps = {w!r} leaves no step for the schedule in a run of {total_steps} optimizer "
            f"step{'s' if total_steps != 1 else ''} (train.max_steps); {fits} or a fraction of the run, which fits "
            f"any length (warmup_steps = 0.05 is {example} step{'s' if example != 1 else ''} here)"
        )
    return w
