"""Config section ``[optimizer]`` (docs/optimizers.md).

Checked when the config is loaded, each with one line naming the key: an unknown type (did-you-mean), a common key
that does not apply to the type, and every other key of the table against the signature of the type's class
(``optimizer.<key>`` is not an argument: the valid keys are listed). The class is imported for that check, so a
missing optional package is reported here too. ``type = "external"`` names any optimizer class: ``torch.optim.*``
by name, anything else only when the person running wantrain allows code (``--allow-code``, ``allow_code=True``:
``wantrain.core.trust``; a config key cannot), judged from the string before any import, the rule of
``wantrain.schedulers.external``.

The common keys default to unset and take the type's default when the section is built (``lr`` is 1.0 for
Prodigy, 1e-4 otherwise; Adafactor keeps no first moment unless ``beta1`` is set), so ``cfg.optimizer.lr`` is
always the base LR the run uses.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from typing import Any

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.errors import ConfigError
from wantrain.core.problems import Problem, bad_value, refuse
from wantrain.core.trust import FLAG, code_allowed, refusal
from wantrain.optimizers.registry import (
    COMMON_KEYS,
    EXTERNAL,
    RESERVED,
    TYPE_NAMES,
    TYPES,
    check_lr_multiplier,
    resolve_type_class,
)

log = logging.getLogger("wantrain.optimizers")
TABLE = "optimizer"
ALLOWED_MODULES = ("torch.optim",)
_EXTERNAL_DEFAULTS = {"lr": 1e-4}
_warned: set[str] = set()


@section
class OptimizerConfig:
    """The optimizer over the LoRA parameter groups (docs/optimizers.md). Keys not listed here are keyword
    arguments of the type's class, checked against its signature (`d_coef = 2.0` for Prodigy, ...)."""

    __wantrain_extra__ = "arguments"

    type: str = setting(
        "adamw", doc="Optimizer type: `adamw` (fused torch AdamW), `adamw8bit` (bitsandbytes), `prodigy` (prodigyopt), "
        "`adafactor` (transformers), `adamw_schedulefree` (schedulefree) or `external` (`class`)."
    )
    lr: float | None = setting(
        None, doc="Base learning rate of every parameter group (unset: 1.0 for `prodigy`, where it multiplies the "
        "estimated step size, 1e-4 otherwise). 0 trains nothing (a check that a run exports what it started from).",
        range=at_least(0.0)
    )
    weight_decay: float | None = setting(None, doc="Decoupled weight decay (unset: 0).", range=at_least(0.0))
    beta1: float | None = setting(
        None, doc="First-moment decay (unset: 0.9; `adafactor`: no first moment).", range=between(0.0, 1.0)
    )
    beta2: float | None = setting(
        None, doc="Second-moment decay (unset: 0.999; not for `adafactor`).", range=between(0.0, 1.0)
    )
    eps: float | None = setting(None, doc="Adam epsilon (unset: 1e-8; not for `adafactor`).", range=above(0.0))
    class_path: str | None = setting(
        None, doc="`external`: dotted path of an optimizer class; `torch.optim.*` is allowed, other modules only "
        "with `--allow-code` on the command line (docs/observers.md, What a config may run).", aliases=("class",)
    )
    allow_external_code: bool = setting(
        False, doc="Accepted for older configs; grants nothing: a config cannot allow code itself (`--allow-code` "
        "does)."
    )
    arguments: dict[str, Any] = setting(
        factory=dict, doc="Keyword arguments of the type's class (the table's other keys)."
    )

    def __attrs_post_init__(self) -> None:
        """Every problem of the section (``core.problems.refuse``: collected by the loader, raised in code), then
        the unset common keys take the type's defaults."""
        defaults, found = _validate(self)
        refuse(found)
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # frozen section: resolved once, at construction

    def optimizer_class(self) -> type:
        """The class this section builds (imported; the section was checked, so this succeeds)."""
        if self.type == EXTERNAL:
            return _resolve_external(self.class_path or "", self.allow_external_code)
        return resolve_type_class(TYPES[self.type])

    def keyword_arguments(self) -> dict[str, Any]:
        """The class's keyword arguments from this section (without ``params``; device-dependent ones such as
        AdamW's ``fused`` are added by :func:`wantrain.optimizers.build_optimizer`)."""
        return class_arguments(self.type, {k: getattr(self, k) for k in COMMON_KEYS}, self.arguments)


def class_arguments(type_name: str, common: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the class of ``type_name`` from the common keys' values and the other keys."""
    kwargs: dict[str, Any] = {}
    if type_name == EXTERNAL:
        kwargs.update({k: common[k] for k in ("lr", "weight_decay", "eps") if common[k] is not None})
    else:
        spec = TYPES[type_name]
        kwargs.update(spec.fixed)
        kwargs.update({k: common[k] for k in ("lr", "weight_decay", "eps", "beta1") if k in spec.defaults})
    if common["beta2"] is not None:
        kwargs.pop("beta1", None)
        kwargs["betas"] = (common["beta1"], common["beta2"])
    kwargs.update(arguments)
    return kwargs


def _valid_keys(cfg: OptimizerConfig, params: list[str]) -> list[str]:
    common = list(COMMON_KEYS) if cfg.type == EXTERNAL else [k for k in COMMON_KEYS if k in TYPES[cfg.type].defaults]
    mapped = {"lr", "weight_decay", "eps", "beta1", "betas"}
    refused = set(RESERVED) | (set(TYPES[cfg.type].refused) if cfg.type in TYPES else set())
    return ["type", *common, *[p for p in params if p not in mapped and p not in refused]]


def _validate(cfg: OptimizerConfig) -> tuple[dict[str, Any], list[Problem]]:
    """Check the section: the defaults of its unset common keys and every problem found (a check that needs the
    class stops at a type or class that cannot be resolved)."""
    found: list[Problem] = []
    if cfg.type not in TYPE_NAMES:
        close = difflib.get_close_matches(cfg.type, TYPE_NAMES, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "valid types: " + ", ".join(TYPE_NAMES)
        return {}, [bad_value(f"{TABLE}.type", f"{TABLE}.type = {cfg.type!r} is not an optimizer type; {hint}")]
    if cfg.type != EXTERNAL:
        for key, name in (("class_path", "class"), ("allow_external_code", "allow_external_code")):
            if getattr(cfg, key):
                found.append(bad_value(f"{TABLE}.{name}", f"{TABLE}.{name} applies only to type = 'external' (type "
                                       f"is {cfg.type!r})"))
        spec = TYPES[cfg.type]
        defaults = spec.defaults
        try:
            cls = resolve_type_class(spec)
        except ImportError as exc:
            return {}, [*found, bad_value(f"{TABLE}.type", str(exc))]
        label = spec.label
    else:
        if cfg.class_path is None:
            return {}, [bad_value(f"{TABLE}.class", f"{TABLE}.class is required when type = 'external' (for example "
                                  "class = 'torch.optim.SGD')")]
        try:
            cls = _resolve_external(cfg.class_path, cfg.allow_external_code)
        except ConfigError as exc:
            return {}, [bad_value(f"{TABLE}.class", str(exc))]
        defaults = _EXTERNAL_DEFAULTS
        label = cfg.class_path
    params = _signature(cls)
    valid = _valid_keys(cfg, params or [])
    for key in COMMON_KEYS:
        if getattr(cfg, key) is not None and cfg.type != EXTERNAL and key not in defaults:
            reason = TYPES[cfg.type].refused.get(key, "it has no such setting")
            found.append(bad_value(f"{TABLE}.{key}", f"{TABLE}.{key} does not apply to type {cfg.type!r} ({reason}); "
                                   "valid keys: " + ", ".join(valid)))
    if (cfg.beta1 is None) != (cfg.beta2 is None) and cfg.type == EXTERNAL:
        found.append(bad_value(f"{TABLE}.beta2", f"{TABLE}.beta1 and {TABLE}.beta2 are passed together as betas to "
                               f"{label}; set both"))
    refused = {**RESERVED, **(TYPES[cfg.type].refused if cfg.type in TYPES else {})}
    for key, value in cfg.arguments.items():
        if key in refused:
            found.append(bad_value(f"{TABLE}.{key}", f"{TABLE}.{key} cannot be set for {label}: {refused[key]}"))
            continue
        if key in COMMON_KEYS:
            continue
        if params is not None and key not in params:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean '{TABLE}.{close[0]}'? " if close else ""
            found.append(bad_value(f"{TABLE}.{key}", f"{TABLE}.{key} is not an argument of {label}; {hint}valid keys: "
                                   + ", ".join(valid)))
            continue
        bad = TYPES[cfg.type].refused_values.get(key) if cfg.type in TYPES else None
        if bad is not None and value == bad[0]:
            found.append(bad_value(f"{TABLE}.{key}", f"{TABLE}.{key} = {value!r} is not supported for type "
                                   f"{cfg.type!r}: {bad[1]}"))
    if params is not None:
        given = {"lr", "weight_decay", "eps", "beta1", "betas"} | set(cfg.arguments)
        for key in ("weight_decay", "eps"):
            if cfg.type == EXTERNAL and getattr(cfg, key) is not None and key not in params:
                found.append(bad_value(f"{TABLE}.{key}", f"{TABLE}.{key} is not an argument of {label}; valid keys: "
                                       + ", ".join(valid)))
        if cfg.type == EXTERNAL and cfg.beta2 is not None and "betas" not in params:
            found.append(bad_value(f"{TABLE}.beta2", f"{TABLE}.beta1/beta2 do not apply to {label} (it takes no "
                                   "betas); valid keys: " + ", ".join(valid)))
        required = [p for p in _required(cls) if p not in given]
        if required:
            found.append(bad_value(f"{TABLE}.{required[0]}", f"{TABLE}.{required[0]} is required by {label} (add it "
                                   f"to the [{TABLE}] table)"))
    try:
        check_lr_multiplier(cfg.type, f"{TABLE}.lr", cfg.lr)
    except ValueError as exc:
        found.append(bad_value(f"{TABLE}.lr", str(exc)))
    if not found:  # the class over the section's values: only once the keys themselves hold
        found += _trial_construction(cfg, cls, label, defaults)
    return {k: v for k, v in defaults.items() if k in COMMON_KEYS}, found


def _signature(cls: type) -> list[str] | None:
    """Keyword-argument names of the constructor after ``params``; None when it takes ``**kwargs`` or cannot be
    introspected (construction reports problems then)."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _required(cls: type) -> list[str]:
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _trial_construction(cfg: OptimizerConfig, cls: type, label: str, defaults: dict[str, Any]) -> list[Problem]:
    """Build the class over a throwaway CPU tensor so that values it rejects are reported with the config."""
    import torch

    common = {k: defaults.get(k) if getattr(cfg, k) is None else getattr(cfg, k) for k in COMMON_KEYS}
    kwargs = class_arguments(cfg.type, common, cfg.arguments)
    try:
        cls([torch.zeros(2, requires_grad=True)], **kwargs)
    except (TypeError, ValueError, KeyError, AssertionError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return [bad_value(TABLE, f"{TABLE}: {label}({shown}) rejected its arguments: {exc}")]
    return []


def is_allowed(class_path: str) -> bool:
    """Whether ``class_path`` lies in an allowed module, judged from the string only (nothing is imported)."""
    module = class_path.rpartition(".")[0]
    return any(module == m or module.startswith(m + ".") for m in ALLOWED_MODULES)


def _resolve_external(class_path: str, allow_external_code: bool) -> type:
    import torch

    parts = class_path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{TABLE}.class = {class_path!r} is not a dotted class path; write it like "
                          "'torch.optim.SGD'")
    if not is_allowed(class_path):
        if not code_allowed():
            not_enough = " (allow_external_code = true in the config is not enough)" if allow_external_code else ""
            raise ConfigError(refusal(f"{TABLE}.class", class_path, ", ".join(ALLOWED_MODULES)) + not_enough)
        if class_path not in _warned:
            _warned.add(class_path)
            log.warning("optimizer: importing %s from outside torch.optim (%s)", class_path, FLAG)
    module_name, name = class_path.rpartition(".")[0], parts[-1]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{TABLE}.class = {class_path!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"{TABLE}.class = {class_path!r} is not an optimizer class (a subclass of "
                          "torch.optim.Optimizer)")
    return cls
