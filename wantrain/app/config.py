"""The root config schema: one section per table, each owned by the package that reads it.

``load_config(path, overrides)`` reads a TOML file, applies ``--set a.b=value`` overrides, and validates every
section (``wantrain.core.config`` explains the error messages). ``docs/config.md`` is generated from this schema
by ``python -m wantrain.app.compose`` (with the compose tables) and a test keeps it in sync.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

import attrs

from wantrain.app.migration import peer_file_problem, peer_hint, table_markdown
from wantrain.core.config import (
    ConfigError,
    check_value,
    config_reference,
    name_sections,
    section,
    setting,
    structure,
    unstructure,
)
from wantrain.core.problems import Problem, refuse
from wantrain.core.settings import (
    CheckpointConfig,
    FaultsConfig,
    ObserversConfig,
    RunSection,
    TrainConfig,
)
from wantrain.data.config import DataConfig
from wantrain.models.wan22.config import LoraConfig, ModelConfig
from wantrain.observers.alpha.config import AlphaScheduleConfig, stability_applicable
from wantrain.observers.evaluation.config import SampleConfig, ValidationConfig
from wantrain.observers.lr_finder.config import LrFinderConfig
from wantrain.optimizers.config import OptimizerConfig
from wantrain.schedulers.config import SchedulerConfig


@section
class LoraSection(LoraConfig):
    """The adapters (`type`: LoRA, LoKr, LoHa or DoRA): one per trained expert on the 10 Linears of every block,
    or those `include` / `exclude` select (see docs/models.md)."""

    # the model plug-in's keys (LoraConfig) plus the alpha controller's table, which only that observer reads
    alpha_schedule: AlphaScheduleConfig | None = setting(
        None, doc="Progressive alpha phases (docs/alpha_schedule.md); absent or `enabled = false` changes nothing.")

    @property
    def schedule_enabled(self) -> bool:
        return self.alpha_schedule is not None and self.alpha_schedule.enabled

    @property
    def effective_alpha(self) -> float:
        """The alpha the LoRA starts with: the first phase's when the alpha schedule is on."""
        if self.schedule_enabled:
            return float(self.alpha_schedule.phases[0].alpha)
        return super().effective_alpha


@section
class RunConfig:
    """A whole training run."""

    run: RunSection = setting(factory=RunSection, doc="Run directory and seed.")
    model: ModelConfig = setting(factory=ModelConfig, doc="Model.")
    lora: LoraSection = setting(factory=LoraSection, doc="LoRA.")
    data: DataConfig = setting(factory=DataConfig, doc="Data.")
    train: TrainConfig = setting(factory=TrainConfig, doc="Training loop.")
    optimizer: OptimizerConfig = setting(factory=OptimizerConfig, doc="Optimizer.")
    lr_scheduler: SchedulerConfig = setting(
        factory=SchedulerConfig, doc="Learning-rate schedule.", aliases=("lr_scheduler_config",)
    )
    observers: ObserversConfig = setting(factory=ObserversConfig, doc="Observers.")
    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig, doc="Resumable checkpoints.")
    faults: FaultsConfig = setting(factory=FaultsConfig, doc="Fault injection (a testing aid).")
    lr_finder: LrFinderConfig = setting(factory=LrFinderConfig, doc="Learning-rate range test.")
    validation: ValidationConfig = setting(factory=ValidationConfig, doc="Validation loss at fixed timesteps.")
    sample: SampleConfig = setting(factory=SampleConfig, doc="Sample videos during training.")

    def __attrs_post_init__(self) -> None:
        # the rules across sections, each declared by the capability that cannot take the other (app.preflight
        # lists them): refused when the config is built, or reported with the document's other problems
        from wantrain.app.preflight import config_problems

        refuse(config_problems(self))
        if self.lora.schedule_enabled and not stability_applicable(self.model.trained_experts,
                                                                   self.model.switch_every, self.model.expert_groups):
            import logging

            logging.getLogger("wantrain.alpha").warning(
                "lora.alpha_schedule: with model.switch_every = 1 and two experts every stint is one step, so "
                "gradient stability has no samples; min_gradient_stability is not applied (raise switch_every to "
                "use it)")


name_sections(RunConfig)  # code-built sections name their keys in errors (``validation.every``)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not of the form section.key=value (for example train.max_steps=20)")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {item!r} names no key; write section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set model.variant=tiny-i2v
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides. A number indexes an array of tables:
    ``lora.alpha_schedule.phases.0.min_steps=5``."""
    for item in overrides:
        parts, value = _parse_override(item)
        table: Any = data
        for part in parts[:-1]:
            if isinstance(table, list):
                table = table[_list_index(table, part, item)]
                if not isinstance(table, dict | list):
                    raise ConfigError(f"--set {item!r}: item '{part}' is a value, not a table")
                continue
            nxt = table.setdefault(part, {})
            if not isinstance(nxt, dict | list):
                raise ConfigError(f"--set {item!r}: '{part}' is a value, not a table")
            table = nxt
        if isinstance(table, list):
            table[_list_index(table, parts[-1], item)] = value
        elif isinstance(table, dict):
            table[parts[-1]] = value
        else:
            raise ConfigError(f"--set {item!r}: '{parts[-2]}' is a value, not a table")
    return data


def _list_index(items: list[Any], part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set {item!r}: '{part}' is not an index of that array (0 to {len(items) - 1})")
    return int(part)


def read_toml(path: Path) -> dict[str, Any]:
    """The config file's TOML. A folder, or a peer trainer's config (``wantrain.app.migration``), is refused with
    one line saying what it is and what to do instead."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"'{path}' is a folder, not a config file; wantrain takes a run config (.toml): copy "
            f"examples/quickstart.toml, set [data] path = \"{path.resolve()}\" and model.variant in it, and pass that "
            "file (wantrain check it first)")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist (pass the path of a .toml file)")
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        problem = peer_file_problem(path, text=path.read_text(encoding="utf-8", errors="replace"))
        raise ConfigError(problem or f"config file '{path}' is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text") from None
    problem = peer_file_problem(path, data)
    if problem:
        raise ConfigError(problem)
    return data


# Keys that say the same thing in two units: an override of one replaces the other as the file gives it (so that
# `--max-steps 5` shortens a `train.max_epochs` config for a smoke run); both in the file, or both overridden, are
# still refused by the section.
EITHER_OR = {("train", "max_steps"): ("train", "max_epochs"), ("train", "save_every"): ("train", "save_every_epochs"),
             ("validation", "every"): ("validation", "every_epochs"), ("sample", "every"): ("sample", "every_epochs")}
EITHER_OR.update({b: a for a, b in EITHER_OR.items()})


def _drop_replaced(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    given = {tuple(_parse_override(item)[0]) for item in overrides}
    for key in given:
        other = EITHER_OR.get(key)
        if other is not None and other not in given and isinstance(data.get(other[0]), dict):
            data[other[0]].pop(other[1], None)
    return data


def _section_of(owner: type, name: str) -> type | None:
    """The section class of ``owner``'s key ``name`` (an optional section too), or ``None`` for a value."""
    if name not in attrs.fields_dict(owner):
        return None
    hint = typing.get_type_hints(owner)[name]
    return next((t for t in typing.get_args(hint) or (hint,) if isinstance(t, type) and attrs.has(t)), None)


def _replaced_file_problems(data: dict[str, Any], overrides: list[str]) -> list[Problem]:
    """A file value that an override replaces is still checked (``max_steps = "400"`` with ``--max-steps 2``): the
    override hides it for this run only. One line each, for keys of the schema's sections (not array items)."""
    problems = []
    for item in overrides:
        parts, _ = _parse_override(item)
        owner: type | None = RunConfig
        table: Any = data
        for part in parts[:-1]:
            owner = _section_of(owner, part) if owner is not None else None
            table = table.get(part) if isinstance(table, dict) else None
        if owner is None or not isinstance(table, dict) or parts[-1] not in table \
                or parts[-1] not in attrs.fields_dict(owner):
            continue
        try:
            check_value(owner, parts[-1], table[parts[-1]], ".".join(parts))
        except ConfigError as exc:
            problems.append(Problem(keys=(".".join(parts),),
                                    what=f"{exc} (in the file; the override replaces it for this run only)"))
    return problems


def peer_key_problems(data: dict[str, Any]) -> list[Problem]:
    """[optimizer] and [lr_scheduler] hand the keys they do not know to the class as its arguments; another
    trainer's name there (``learning_rate``) is a problem naming the wantrain key, unless the table names a class
    of the user's own (whose arguments may be called anything). Every one, for the loader's one report; each is
    taken out of ``data`` (the table's class would refuse it a second time, as an argument it does not take)."""
    out = []
    for name in ("optimizer", "lr_scheduler"):
        table = data.get(name)
        if not isinstance(table, dict) or "class" in table or "class_path" in table:
            continue
        for key in list(table):
            hint = peer_hint(key, table[key])
            if hint:
                out.append(Problem(keys=(f"{name}.{key}",), what=f"unknown config key '{name}.{key}': {hint}"))
                del table[key]
    return out


def load_config(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, override and validate a run config: every problem of it in one :class:`Refused` (unknown and peer
    keys, wrong types and values, the rules across keys). Paths in it may start with ``~`` (the home folder,
    expanded when the key is read); a relative path in the file is resolved against the file's folder, one given
    with ``--set`` against the current directory (as a shell user expects). An override of a key in
    :data:`EITHER_OR` replaces its other-unit twin from the file (``train.max_steps`` replaces ``max_epochs``)."""
    path = Path(path)
    data = read_toml(path)
    found = _replaced_file_problems(data, list(overrides))
    data = apply_overrides(_drop_replaced(data, list(overrides)), list(overrides))
    cfg = structure(RunConfig, data, hint=peer_hint, found=[*found, *peer_key_problems(data)])
    typed = {".".join(_parse_override(item)[0]) for item in overrides}
    return resolve_paths(cfg, path.parent, typed=typed)


def resolve_paths(cfg: RunConfig, base: Path, *, typed: set[str] | frozenset[str] = frozenset()) -> RunConfig:
    """Make relative paths of the config relative to ``base`` (the config file's folder), those of the keys in
    ``typed`` (given on the command line: ``data.path``, ``data.datasets.0.path``) relative to the current
    directory. ``~`` was expanded when the config was structured, so a home-relative path is absolute here."""
    import attrs

    def fix(obj: Any, key: str) -> Any:
        if attrs.has(type(obj)):
            changes = {}
            for f in attrs.fields(type(obj)):
                v = getattr(obj, f.name)
                nv = fix(v, f"{key}.{f.name}" if key else f.name)
                if nv is not v:
                    changes[f.name] = nv
            return attrs.evolve(obj, **changes) if changes else obj
        if isinstance(obj, Path) and not obj.is_absolute():
            typed_here = any(key == t or key.startswith(t + ".") for t in typed)
            return ((Path.cwd() if typed_here else base) / obj).resolve()
        if isinstance(obj, list):
            new = [fix(v, f"{key}.{i}") for i, v in enumerate(obj)]
            return new if any(a is not b for a, b in zip(new, obj, strict=True)) else obj
        return obj

    return fix(cfg, "")


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    return unstructure(cfg)


def reference_markdown(compose_table: str) -> str:
    """docs/config.md: the keys of every section, ``compose_table`` (``app.compose.compose_markdown``: the pairs
    the pre-flight refuses), then the peers' keys. ``python -m wantrain.app.compose`` writes it."""
    header = (
        "# Config reference\n\n"
        "Generated from the schema by `python -m wantrain.app.compose`; a test keeps it in sync.\n"
        "Every key is checked: an unknown or misplaced key, a wrong type or an out-of-range value stops wantrain\n"
        "with one line naming the key and what would be valid (exit code 2). `--set section.key=value` overrides\n"
        "any key from the command line (the value is read as TOML; a bare word is a string). A relative path is\n"
        "relative to the config file's folder (one given with `--set`: to the current directory, as a shell user\n"
        "expects); a path may start with `~` (your home folder). Every problem of a config is reported at once,\n"
        "one line each, grouped by table: unknown keys, wrong values and the pairs below.\n\n"
        "Values are checked for what they mean, too: NaN and infinities are refused in every number key (and in\n"
        "the numbers of an optimizer's or scheduler's own arguments); `lora.rank` may not exceed the width of the\n"
        "layers it adapts (24 for the tiny models, 5120 for the A14B ones, 3072 for TI2V-5B); a learning rate above\n"
        "1 is refused for the optimizers whose `lr` is the step size itself (every type but `prodigy`, whose `lr`\n"
        "is a multiplier of about 1); a plan that no accelerator's memory holds is refused by `check` and `run`.\n\n"
    )
    return header + config_reference(RunConfig) + "\n" + compose_table + "\n" + table_markdown()
