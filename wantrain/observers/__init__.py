"""Observers: independent features that subscribe to the bus.

Users write their own by subclassing :class:`Observer` and marking handlers with :func:`on`; list them in the
config as ``[observers] extra = ["package.module:ClassName"]``. See the README for a complete example.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.errors import UserError

__all__ = ["Observer", "Priority", "build_observers", "load_observer_class", "on", "resolve_extra_observers"]


def load_observer_class(spec: str, *, key: str = "observers.extra", search_dirs: tuple[Path, ...] = ()) -> type:
    """Import ``package.module:ClassName``. ``search_dirs`` (the config file's folder, the working directory) are
    tried before the installed packages. Errors are one line naming the config key."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise UserError(f"{key} = {spec!r} is not of the form 'package.module:ClassName'")
    module_name, class_name = spec.split(":")
    added = [str(d) for d in search_dirs if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{key} = {spec!r}: cannot import module {module_name!r} ({exc})") from None
    finally:
        for d in added:
            sys.path.remove(d)
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise UserError(f"{key} = {spec!r}: module {module_name!r} has no class {class_name!r}")
    if not callable(getattr(cls, "handlers", None)):
        raise UserError(
            f"{key} = {spec!r}: {class_name} is not an observer (subclass wantrain.observers.Observer and mark "
            "handlers with @on(EventType))"
        )
    return cls


def resolve_extra_observers(cfg: Any, config_dir: Path | None = None) -> list[type]:
    """Import the classes of ``[observers] extra`` (one-line errors). Done before the run directory exists, so a
    typo there leaves nothing behind."""
    search = tuple(d for d in (config_dir, Path.cwd()) if d is not None)
    return [load_observer_class(spec, key=f"observers.extra[{i}]", search_dirs=search)
            for i, spec in enumerate(cfg.observers.extra)]


def build_observers(cfg: Any, run_dir: Path, *, extra: Sequence[type] = (),
                    hparams: dict[str, Any] | None = None, writes_files: bool = True) -> list[Any]:
    """The observers a run config asks for, in attachment order. ``extra`` are the users' classes from
    :func:`resolve_extra_observers`, built here with no arguments. ``writes_files`` False (torchrun ranks other
    than 0): the same observers, minus the sinks (TensorBoard, JSONL, the progress line) and the alpha controller's
    JSONL file, so that every rank computes and decides alike and only rank 0 writes."""
    from wantrain.observers.run_log import RunLog
    from wantrain.optimizers.registry import TYPES

    obs_cfg = cfg.observers
    observers: list[Any] = [RunLog()]
    if obs_cfg.memory_probe:
        from wantrain.observers.memory_probe import MemoryProbe

        observers.append(MemoryProbe())
    if obs_cfg.norms:
        from wantrain.observers.norms import Norms

        observers.append(Norms())
    if obs_cfg.tensorboard and writes_files:
        from wantrain.observers.tensorboard import TensorBoardWriter

        observers.append(TensorBoardWriter(run_dir / "tensorboard", hparams=hparams))
    if obs_cfg.jsonl and writes_files:
        from wantrain.observers.jsonl_metrics import JsonlMetrics

        observers.append(JsonlMetrics(run_dir / "metrics.jsonl"))
    if obs_cfg.progress and writes_files:
        from wantrain.observers.progress import ProgressLine

        observers.append(ProgressLine())
    lora = getattr(cfg, "lora", None)
    if getattr(lora, "schedule_enabled", False):  # absent or disabled: no observer, no file, nothing changes
        from wantrain.observers.alpha_controller import AlphaController

        observers.append(AlphaController(lora.alpha_schedule, cfg.model.trained_experts,
                                         metrics_path=run_dir / "alpha_metrics.jsonl" if writes_files else None))
    adaptive = getattr(TYPES.get(cfg.optimizer.type), "adaptive_lr", None)
    if adaptive is not None:  # Prodigy: log d and d * lr (optimizer/effective_lr/<group>)
        from wantrain.observers.adaptive_lr import AdaptiveLR

        observers.append(AdaptiveLR(adaptive))
    for i, (spec, cls) in enumerate(zip(obs_cfg.extra, extra, strict=True)):
        try:
            observers.append(cls())
        except TypeError as exc:
            raise UserError(f"observers.extra[{i}] = {spec!r}: cannot build it with no arguments ({exc})") from None
    return observers
