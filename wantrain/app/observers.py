"""THE table of built-in observers (:data:`BUILT_IN`): per observer its ``--observers`` name, its class, the config
switch that turns it on, whether only rank 0 runs it (a sink that writes files) and its factory. Whether it is
replayable is the class's own ``replayable``. The assembly (:func:`build_observers`) and replay
(``wantrain.app.replay``) both read this table; users' observers (``[observers] extra``) come after it, imported
only with the person's consent (``--allow-code``: ``wantrain.core.trust``).

Classes are imported when a row is used (:meth:`BuiltIn.load`): a run without TensorBoard never imports tensorboardX.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from wantrain.core.atomic import atomic_write
from wantrain.core.errors import UserError
from wantrain.core.trust import code_allowed, refusal
from wantrain.observers.alpha.config import stability_applicable
from wantrain.optimizers.registry import TYPES


@attrs.frozen
class Where:
    """What a factory may use besides the config."""

    run_dir: Path
    hparams: dict[str, Any] | None
    writes_files: bool  # False: a torchrun rank other than 0
    experts: tuple[str | None, ...]  # the run's trained experts: with model.expert_groups every group's, in order


@attrs.frozen
class BuiltIn:
    key: str  # the --observers name
    target: str  # "module:Class"
    enabled: Callable[[Any], bool]  # from the run config
    build: Callable[[type, Any, Where], Any]  # (class, config, where) -> the observer
    flag: str | None = None  # the --set that turns it on (replay --observers KEY)
    sink: bool = False  # writes files: rank 0 only

    def load(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def observer_name(self) -> str:
        """The built observer's ``name`` (its class name unless the class sets one)."""
        cls = self.load()
        name = cls.__dict__.get("name")
        return name if isinstance(name, str) else cls.__name__

    @property
    def replayable(self) -> bool:
        return bool(getattr(self.load(), "replayable", False))


def _adaptive(cfg: Any) -> Any:
    return getattr(TYPES.get(cfg.optimizer.type), "adaptive_lr", None)


def _alpha_enabled(cfg: Any) -> bool:
    return bool(getattr(getattr(cfg, "lora", None), "schedule_enabled", False))  # absent or off: nothing changes


def _phase_names(cfg: Any) -> tuple[str, ...]:
    return tuple(p.name for p in cfg.lora.alpha_schedule.phases) if _alpha_enabled(cfg) else ()


BUILT_IN: tuple[BuiltIn, ...] = (
    BuiltIn("run_log", "wantrain.observers.run_log:RunLog", lambda cfg: True, lambda cls, cfg, w: cls()),
    BuiltIn("memory_probe", "wantrain.observers.memory_probe:MemoryProbe", lambda cfg: cfg.observers.memory_probe,
            lambda cls, cfg, w: cls(), flag="observers.memory_probe=true"),
    BuiltIn("norms", "wantrain.observers.norms:Norms", lambda cfg: cfg.observers.norms, lambda cls, cfg, w: cls(),
            flag="observers.norms=true"),
    BuiltIn("tensorboard", "wantrain.observers.tensorboard:TensorBoardWriter", lambda cfg: cfg.observers.tensorboard,
            lambda cls, cfg, w: cls(w.run_dir / "tensorboard", hparams=w.hparams),
            flag="observers.tensorboard=true", sink=True),
    BuiltIn("jsonl", "wantrain.observers.jsonl_metrics:JsonlMetrics", lambda cfg: cfg.observers.jsonl,
            lambda cls, cfg, w: cls(w.run_dir / "metrics.jsonl"), flag="observers.jsonl=true", sink=True),
    BuiltIn("progress", "wantrain.observers.progress:ProgressLine", lambda cfg: cfg.observers.progress,
            lambda cls, cfg, w: cls(alpha_phases=_phase_names(cfg), compiling=cfg.model.compile != "off"),
            flag="observers.progress=true", sink=True),
    # every rank decides alike, for every expert of the run (with model.expert_groups: every group's, from the
    # reduced metrics); only rank 0 writes alpha_metrics.jsonl
    BuiltIn("alpha", "wantrain.observers.alpha.controller:AlphaController", _alpha_enabled,
            lambda cls, cfg, w: cls(cfg.lora.alpha_schedule, w.experts,
                                    metrics_path=w.run_dir / "alpha_metrics.jsonl" if w.writes_files else None,
                                    stability_applicable=stability_applicable(
                                        w.experts, cfg.model.switch_every, cfg.model.expert_groups))),
    BuiltIn("wandb", "wantrain.observers.wandb_logger:WandbLogger", lambda cfg: cfg.observers.wandb,
            lambda cls, cfg, w: cls(project=cfg.observers.wandb_project, run_name=cfg.observers.wandb_run_name,
                                    tags=cfg.observers.wandb_tags, mode=cfg.observers.wandb_mode, config=w.hparams),
            sink=True),
    # Prodigy: log d and d * lr (optimizer/effective_lr/<group>)
    BuiltIn("adaptive_lr", "wantrain.observers.adaptive_lr:AdaptiveLR", lambda cfg: _adaptive(cfg) is not None,
            lambda cls, cfg, w: cls(_adaptive(cfg))),
)
"""The built-in observers in attachment order."""

BY_KEY = {row.key: row for row in BUILT_IN}


def require_wandb() -> None:
    """Refuse ``observers.wandb = true`` without the package, in one line (before the run directory exists)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise UserError("observers.wandb = true needs the wandb package: pip install 'wantrain[wandb]' (or set "
                        "observers.wandb = false)")


def build_observers(cfg: Any, run_dir: Path, *, extra: Sequence[type] = (),
                    hparams: dict[str, Any] | None = None, writes_files: bool = True,
                    without: Sequence[str] = (), experts: Sequence[str | None] | None = None) -> list[Any]:
    """The observers a run config asks for, in attachment order. ``extra`` are the users' classes from
    :func:`resolve_extra_observers`, built here with no arguments. ``writes_files`` False (torchrun ranks other
    than 0): the same observers, minus the sinks (TensorBoard, JSONL, the progress line) and the alpha controller's
    JSONL file, so that every rank computes and decides alike and only rank 0 writes. ``without``: names of built-in
    rows left out (the LR finder's sweep runs no alpha controller). ``experts``: the run's trained experts when
    they are not ``cfg``'s (with ``model.expert_groups`` each rank's ``cfg`` holds its group's expert only)."""
    run_experts = tuple(experts) if experts is not None else tuple(cfg.model.trained_experts)
    where = Where(Path(run_dir), hparams, writes_files, run_experts)
    observers = [row.build(row.load(), cfg, where) for row in BUILT_IN
                 if row.enabled(cfg) and (writes_files or not row.sink) and row.key not in without]
    for i, (spec, cls) in enumerate(zip(cfg.observers.extra, extra, strict=True)):
        try:
            observers.append(cls())
        except TypeError as exc:
            raise UserError(f"observers.extra[{i}] = {spec!r}: cannot build it with no arguments ({exc})") from None
    return observers


OWN_MODULES = ("wantrain",)
"""What ``[observers] extra`` may name without ``--allow-code``: wantrain's own modules (``wantrain.core.trust``)."""


def load_observer_class(spec: str, *, key: str = "observers.extra", search_dirs: tuple[Path, ...] = ()) -> type:
    """Import ``package.module:ClassName``. A module outside :data:`OWN_MODULES` is imported only when the person
    running wantrain allows code (``--allow-code``, ``allow_code=True``; :func:`wantrain.core.trust.code_allowed`),
    judged from the string before anything is imported; then ``search_dirs`` (the config file's folder, the working
    directory) are tried before the installed packages. Errors are one line naming the config key."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise UserError(f"{key} = {spec!r} is not of the form 'package.module:ClassName'")
    module_name, class_name = spec.split(":")
    if module_name.partition(".")[0] not in OWN_MODULES and not code_allowed():
        raise UserError(refusal(key, spec, ", ".join(f"{m}.*" for m in OWN_MODULES)))
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


def observer_search_dirs(config_dir: Path | None) -> tuple[Path, ...]:
    """Where users' observers are looked for before the installed packages: the config's folder, then the working
    directory (``run`` and ``check`` pass the config's folder; ``replay`` the one the run recorded)."""
    return tuple(d for d in (config_dir, Path.cwd()) if d is not None)


CONFIG_SOURCE = "config_source.json"
"""Where the run's config file was (``{"config_dir": ..., "config_file": ...}``): replay looks for users' observers
in the folder, as run did; ``--resume auto`` continues only a run of the same file (``wantrain.app.resume``)."""


def write_config_source(run_dir: Path, config_dir: Path | None, config_file: Path | None = None) -> None:
    """Record the config's folder (and file, when the run was given one) in the run directory (nothing when the
    run was given a loaded config)."""
    path = run_dir / CONFIG_SOURCE
    if config_dir is None:
        path.unlink(missing_ok=True)  # a resume from Python: the folder recorded before no longer applies
        return
    record = {"config_dir": str(Path(config_dir).resolve())}
    if config_file is not None:
        record["config_file"] = str(Path(config_file).resolve())
    atomic_write(path, json.dumps(record) + "\n", what="run file")


def read_config_source(run_dir: Path) -> Path | None:
    """The config folder a run recorded (:func:`write_config_source`), or None."""
    try:
        recorded = json.loads((Path(run_dir) / CONFIG_SOURCE).read_text(encoding="utf-8"))["config_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # older runs have no record; a damaged one is no reason to refuse a replay
    return Path(recorded) if isinstance(recorded, str) else None


def read_config_file(run_dir: Path) -> str | None:
    """The config file a run recorded (:func:`write_config_source`, resolved), or None (a loaded config, an older
    run, a damaged record)."""
    try:
        recorded = json.loads((Path(run_dir) / CONFIG_SOURCE).read_text(encoding="utf-8")).get("config_file")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) else None


def resolve_extra_observers(cfg: Any, config_dir: Path | None = None) -> list[type]:
    """Import the classes of ``[observers] extra`` (one-line errors). Done before the run directory exists, so a
    typo there, or code the person did not allow, leaves nothing behind."""
    search = observer_search_dirs(config_dir)
    return [load_observer_class(spec, key=f"observers.extra[{i}]", search_dirs=search)
            for i, spec in enumerate(cfg.observers.extra)]
