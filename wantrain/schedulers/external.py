"""``type = "external"``: a scheduler class named in the config, built with the table's other keys.

Naming a class in a config must not run arbitrary code. The allowlist is decided from the dotted string alone,
before anything is imported (importing a module runs its top-level code): the class must live in one of
:data:`ALLOWED_MODULES` or a submodule of one, unless the person running wantrain allows code
(``--allow-code``, ``allow_code=True``: :mod:`wantrain.core.trust`; ``allow_external_code = true`` in the config
grants nothing), which is logged as a warning. After import the class must be a torch ``LRScheduler`` or a timm
scheduler (adapted to optimizer-step units); ``ReduceLROnPlateau`` is refused (see :data:`_PLATEAU_REASON`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from typing import Any

from wantrain.core.errors import ConfigError
from wantrain.core.trust import FLAG, code_allowed, refusal

log = logging.getLogger("wantrain.schedulers")

ALLOWED_MODULES = ("torch.optim.lr_scheduler", "timm.scheduler", "transformers.optimization")
TABLE = "lr_scheduler"

# Arguments wantrain supplies or owns: the optimizer is passed in, and resume restores the state_dict instead.
_RESERVED = {
    "optimizer": "wantrain passes the optimizer itself",
    "last_epoch": "wantrain resumes from the saved scheduler state, not from last_epoch",
}
_PLATEAU_REASON = (
    "it steps on a metric, and reading the training loss from the device every step would force a device-to-host "
    "sync per step, which wantrain does not do; use a fixed schedule (cosine, linear, ...) instead"
)
_warned: set[str] = set()


def is_allowed(class_path: str) -> bool:
    """Whether ``class_path`` lies in an allowed module, judged from the string only (nothing is imported)."""
    module = class_path.rpartition(".")[0]
    return any(module == m or module.startswith(m + ".") for m in ALLOWED_MODULES)


def _split(class_path: str) -> tuple[str, str]:
    parts = class_path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(
            f"{TABLE}.class = {class_path!r} is not a dotted class path; write it like "
            "'torch.optim.lr_scheduler.StepLR'"
        )
    return ".".join(parts[:-1]), parts[-1]


def resolve_class(class_path: str, *, allow_external_code: bool) -> tuple[type, str]:
    """Import and return ``(cls, kind)`` with kind ``"torch"`` or ``"timm"``; raises ``ConfigError`` (one line).

    The allowlist check happens first and on the string alone, so a refused module is never imported.
    """
    module_name, class_name = _split(class_path)
    if not is_allowed(class_path):
        if not code_allowed():
            not_enough = " (allow_external_code = true in the config is not enough)" if allow_external_code else ""
            raise ConfigError(refusal(f"{TABLE}.class", class_path, ", ".join(ALLOWED_MODULES)) + not_enough)
        if class_path not in _warned:
            _warned.add(class_path)
            log.warning("lr_scheduler: importing %s from outside the allowed modules (%s)", class_path, FLAG)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{TABLE}.class = {class_path!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        names = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
        close = difflib.get_close_matches(class_name, names, n=1)
        hint = f"; did you mean '{module_name}.{close[0]}'?" if close else ""
        raise ConfigError(f"{TABLE}.class = {class_path!r}: module {module_name!r} has no {class_name!r}{hint}")
    if not isinstance(cls, type):
        raise ConfigError(
            f"{TABLE}.class = {class_path!r} is not a class; wantrain needs a learning-rate scheduler class "
            "(a torch LRScheduler subclass or a timm scheduler)"
        )
    import torch.optim.lr_scheduler as torch_sched

    if issubclass(cls, torch_sched.ReduceLROnPlateau) or (_is_timm(cls) and "Plateau" in cls.__name__):
        raise ConfigError(f"{TABLE}.class = {class_path!r} is not supported: {_PLATEAU_REASON}")
    if issubclass(cls, torch_sched.LRScheduler):
        return cls, "torch"
    if _is_timm(cls):
        return cls, "timm"
    raise ConfigError(
        f"{TABLE}.class = {class_path!r} is not a learning-rate scheduler (expected a subclass of "
        "torch.optim.lr_scheduler.LRScheduler or a timm.scheduler class)"
    )


def _is_timm(cls: type) -> bool:
    # Recognised by where it is defined, so timm itself need not be imported to tell.
    return any(getattr(c, "__module__", "").startswith("timm.scheduler") for c in cls.__mro__) and all(
        callable(getattr(cls, m, None)) for m in ("step", "step_update", "state_dict", "load_state_dict")
    )


def check_arguments(cls: type, class_path: str, args: dict[str, Any]) -> None:
    """Check ``args`` against the constructor's signature (the first parameter is the optimizer)."""
    for key, reason in _RESERVED.items():
        if key in args:
            raise ConfigError(f"{TABLE}.{key} cannot be set for {class_path}: {reason}")
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return  # no introspectable signature; construction reports problems
    params = params[1:]  # the optimizer
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    if not takes_any:
        for key in args:
            if key not in named:
                valid = [n for n in named if n not in _RESERVED]
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f"did you mean '{TABLE}.{close[0]}'?" if close else "its arguments: " + ", ".join(valid)
                raise ConfigError(f"{TABLE}.{key} is not an argument of {class_path}; {hint}")
    for name, p in named.items():
        if p.default is p.empty and name not in args:
            raise ConfigError(f"{TABLE}.{name} is required by {class_path} (add it to the [{TABLE}] table)")


def instantiate(cls: type, class_path: str, optimizer: Any, args: dict[str, Any]) -> Any:
    try:
        return cls(optimizer, **args)
    except (TypeError, ValueError, KeyError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"{TABLE}: {class_path}({shown}) rejected its arguments: {exc}") from None


def check_external(class_path: str, args: dict[str, Any], *, allow_external_code: bool) -> None:
    """Config-time check: allowlist, class kind, signature, and a trial construction on a throwaway optimizer
    (so that values the class rejects are reported when the config is loaded, not after the model)."""
    cls, _ = resolve_class(class_path, allow_external_code=allow_external_code)
    check_arguments(cls, class_path, args)
    import torch

    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    scheduler = instantiate(cls, class_path, probe, args)
    probe.step()  # no gradients: changes nothing, but keeps torch's step-order warning quiet
    try:
        if _is_timm(cls):
            scheduler.step(1)
        else:
            scheduler.step()
    except (ArithmeticError, TypeError, ValueError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"{TABLE}: {class_path}({shown}) fails on its first step: {exc!r}") from None


class ExternalScheduler:
    """Wraps an external scheduler to the :class:`wantrain.schedulers.Scheduler` interface.

    ``step()`` is one optimizer step. torch schedulers are stepped as they are; timm schedulers count in
    "epochs" or "updates", and wantrain feeds them the optimizer-step count (``step(k)`` when ``t_in_epochs``,
    else ``step_update(k)``). The state dict holds the class path, the step and the class's own state dict
    (JSON-safe when the class's is; torch's common schedulers are).
    """

    def __init__(self, class_path: str, args: dict[str, Any], optimizer: Any, *, allow_external_code: bool) -> None:
        cls, self.kind = resolve_class(class_path, allow_external_code=allow_external_code)
        check_arguments(cls, class_path, args)
        self.class_path = class_path
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.inner = instantiate(cls, class_path, optimizer, args)
        self.last_step = 0
        if self.kind == "timm":
            self._timm_apply(0)

    def _timm_apply(self, step: int) -> None:
        if getattr(self.inner, "t_in_epochs", True):
            self.inner.step(step)
        else:
            self.inner.step_update(step)

    def step(self) -> None:
        self.last_step += 1
        if self.kind == "timm":
            self._timm_apply(self.last_step)
        else:
            self.inner.step()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "external", "class": self.class_path, "step": self.last_step,
                "scheduler": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "external":
            raise ConfigError(
                f"the saved LR scheduler is a built-in {state.get('type')!r} schedule but {TABLE}.type is "
                "'external'; resume with the schedule the run was started with"
            )
        if state.get("class") != self.class_path:
            log.warning("lr_scheduler: resuming %s from the state of %s", self.class_path, state.get("class"))
        self.last_step = int(state["step"])
        self.inner.load_state_dict(state["scheduler"])
        if self.kind == "timm":
            self._timm_apply(self.last_step)
        else:
            # torch's load_state_dict leaves the groups alone, and chainable schedulers (StepLR, ...) compute
            # the next LR from the group's current one; put back the LR of the saved step.
            for group, lr in zip(self.optimizer.param_groups, self.inner.get_last_lr(), strict=True):
                group["lr"] = lr
