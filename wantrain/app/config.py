"""The root config schema: one section per table, each owned by the package that reads it.

``load_config(path, overrides)`` reads a TOML file, applies ``--set a.b=value`` overrides, and validates every
section (``wantrain.core.config`` explains the error messages). ``docs/config.md`` is generated from this schema
by ``python -m wantrain.app.config`` and a test keeps it in sync.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

import attrs

from wantrain.app.layouts import problems as layout_problems
from wantrain.app.migration import peer_file_problem, peer_hint, peer_key_problems, table_markdown
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
from wantrain.core.errors import UserError
from wantrain.core.settings import (
    CheckpointConfig,
    FaultsConfig,
    ObserversConfig,
    RunSection,
    TrainConfig,
)
from wantrain.data.config import DataConfig
from wantrain.models.wan22.adapter_types import candidate_modules, select_modules
from wantrain.models.wan22.config import QUANTISED_DTYPES, LoraConfig, ModelConfig
from wantrain.models.wan22.variants import VARIANTS
from wantrain.observers.alpha.config import AlphaScheduleConfig, stability_applicable
from wantrain.observers.evaluation.config import SampleConfig, ValidationConfig
from wantrain.observers.lr_finder.config import LrFinderConfig, check_run_id
from wantrain.optimizers.config import OptimizerConfig
from wantrain.optimizers.registry import check_lr_multiplier
from wantrain.schedulers.config import SchedulerConfig


@section
class LoraSection(LoraConfig):
    """The adapters (`type`: LoRA, LoKr, LoHa or DoRA): one per trained expert on the 10 Linears of every block,
    or those `include` / `exclude` select (see docs/models.md)."""

    # the model plug-in's keys (LoraConfig) plus the alpha controller's table, which only that observer reads
    alpha_schedule: AlphaScheduleConfig | None = setting(
        None, doc="Progressive alpha phases (docs/alpha_schedule.md); absent or `enabled = false` changes nothing.")

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
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
        for key in ("lr_high_noise", "lr_low_noise"):  # per-expert LRs multiply an adaptive optimizer's estimate too
            try:
                check_lr_multiplier(self.optimizer.type, f"model.{key}", getattr(self.model, key))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        _check_alpha_schedule(self)
        if self.lora.type == "dora" and self.model.base_dtype in QUANTISED_DTYPES:  # "auto" plans bf16 for DoRA
            raise ConfigError(
                f"lora.type = 'dora' reads the base weights outside their forward pass, which fp8 and low-bit "
                f"storage do not dequantize there (model.base_dtype = '{self.model.base_dtype}'); set "
                "model.base_dtype = 'bf16' or use another lora.type")
        for problem in layout_problems(self)[:1]:  # fsdp with DoRA, 8-bit AdamW, Adafactor, the alpha schedule
            raise ConfigError(problem)
        if self.lora.include or self.lora.exclude:  # against the variant's module names, before anything is written
            try:
                spec = VARIANTS[self.model.variant]
                select_modules(candidate_modules(spec.num_layers, len(spec.vace_layers)), self.lora.include,
                               self.lora.exclude)
            except UserError as exc:
                raise ConfigError(str(exc)) from None
        _check_expert_groups(self)
        if self.lr_finder.active:
            check_run_id(self.run.run_id)  # the sweep's run directory adds __lr_finder to the id


def _check_expert_groups(cfg: RunConfig) -> None:
    """What one expert per group of GPUs cannot run (read time). Samples and validation run across the groups
    (``core.parallel.expert_relay``, docs/distributed.md); these stay refused: the LR finder sweeps the experts one
    after the other on every rank (a sequential sweep has nothing for the second group to do), and the low-noise group's
    alpha controller would decide where rank 0's event log never sees it (replay could not reproduce it).
    ``sample.other_expert_lora`` has no expert to load into (the other group trains it)."""
    if cfg.model.expert_groups <= 1:
        return
    groups = f"model.expert_groups = {cfg.model.expert_groups}"
    for on, key in ((cfg.lr_finder.active, "lr_finder"), (cfg.lora.schedule_enabled, "lora.alpha_schedule")):
        if on:
            raise ConfigError(f"{groups} does not run with {key} (each group holds one expert; the sweep and the "
                              f"alpha decisions run on one rank): turn {key} off, or set model.expert_groups = 1")
    if cfg.sample.enabled and cfg.sample.other_expert_lora is not None:
        raise ConfigError(f"config key 'sample.other_expert_lora' does nothing with {groups}: the other group "
                          "trains that expert and samples with it; remove the key, or set model.expert_groups = 1")


def _check_alpha_schedule(cfg: RunConfig) -> None:
    """The alpha schedule against the other tables (read time, before anything is written)."""
    if not cfg.lora.schedule_enabled:
        return
    schedule = cfg.lora.alpha_schedule
    if schedule.signal == "validation":
        _check_validation_signal(cfg)
    if schedule.transition == "preserve_output":
        from wantrain.core.optim_state import STATE_MAPS
        from wantrain.optimizers.registry import EXTERNAL, TYPES

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
            raise ConfigError(
                f"lora.alpha_schedule.transition = 'preserve_output' cannot carry the state of {what} across an "
                f"alpha change{why}; use transition = 'jump' or optimizer.type = one of {mapped}"
            )
    if not stability_applicable(cfg.model.trained_experts, cfg.model.switch_every):
        import logging

        logging.getLogger("wantrain.alpha").warning(
            "lora.alpha_schedule: with model.switch_every = 1 and two experts every stint is one step, so gradient "
            "stability has no samples; min_gradient_stability is not applied (raise switch_every to use it)")


def _check_validation_signal(cfg: RunConfig) -> None:
    """``signal = "validation"`` needs validation losses of every trained expert."""
    if not cfg.validation.enabled:
        raise ConfigError(
            "lora.alpha_schedule.signal = 'validation' needs the validation loss, but [validation] is not enabled; "
            "set validation.enabled = true (with validation.path or validation.from_training) or use signal = 'train'"
        )
    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS.get(cfg.model.variant)
    boundary = spec.boundary_ratio if spec is not None else None
    if boundary is None:
        return
    owned = {"high_noise" if t >= boundary else "low_noise" for t in cfg.validation.timesteps}
    missing = [e for e in cfg.model.trained_experts if e not in owned]
    if missing:
        raise ConfigError(
            f"lora.alpha_schedule.signal = 'validation': validation.timesteps = {list(cfg.validation.timesteps)} "
            f"has no timestep of the {missing[0]} expert (high_noise owns t >= {boundary:g}), so its phase could "
            "never end; add one to validation.timesteps"
        )


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


def _replaced_file_problems(data: dict[str, Any], overrides: list[str]) -> list[str]:
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
            problems.append(f"{exc} (in the file; the override replaces it for this run only)")
    return problems


def load_config(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, override and validate a run config. Paths in it may start with ``~`` (the home folder, expanded
    when the key is read); relative paths are resolved against the file's folder. An override of a key in
    :data:`EITHER_OR` replaces its other-unit twin from the file (``train.max_steps`` replaces ``max_epochs``)."""
    path = Path(path)
    data = read_toml(path)
    found = _replaced_file_problems(data, list(overrides))
    data = apply_overrides(_drop_replaced(data, list(overrides)), list(overrides))
    cfg = structure(RunConfig, data, hint=peer_hint, found=[*found, *peer_key_problems(data)])
    return resolve_paths(cfg, path.parent)


def resolve_paths(cfg: RunConfig, base: Path) -> RunConfig:
    """Make relative paths of the config relative to ``base`` (the config file's folder). ``~`` was expanded
    when the config was structured, so a home-relative path is absolute here."""
    import attrs

    def fix(obj: Any) -> Any:
        if attrs.has(type(obj)):
            changes = {}
            for f in attrs.fields(type(obj)):
                v = getattr(obj, f.name)
                nv = fix(v)
                if nv is not v:
                    changes[f.name] = nv
            return attrs.evolve(obj, **changes) if changes else obj
        if isinstance(obj, Path) and not obj.is_absolute():
            return (base / obj).resolve()
        if isinstance(obj, list):
            new = [fix(v) for v in obj]
            return new if any(a is not b for a, b in zip(new, obj, strict=True)) else obj
        return obj

    return fix(cfg)


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    return unstructure(cfg)


def reference_markdown() -> str:
    header = (
        "# Config reference\n\n"
        "Generated from the schema by `python -m wantrain.app.config > docs/config.md`; a test keeps it in sync.\n"
        "Every key is checked: an unknown or misplaced key, a wrong type or an out-of-range value stops wantrain\n"
        "with one line naming the key and what would be valid (exit code 2). `--set section.key=value` overrides\n"
        "any key from the command line (the value is read as TOML; a bare word is a string). A relative path is\n"
        "relative to the config file's folder; a path may start with `~` (your home folder).\n\n"
        "Values are checked for what they mean, too: NaN and infinities are refused in every number key (and in\n"
        "the numbers of an optimizer's or scheduler's own arguments); `lora.rank` may not exceed the width of the\n"
        "layers it adapts (24 for the tiny models, 5120 for the A14B ones, 3072 for TI2V-5B); a learning rate above\n"
        "1 is refused for the optimizers whose `lr` is the step size itself (every type but `prodigy`, whose `lr`\n"
        "is a multiplier of about 1); a plan that no accelerator's memory holds is refused by `check` and `run`.\n\n"
    )
    return header + config_reference(RunConfig) + "\n" + table_markdown()


if __name__ == "__main__":
    print(reference_markdown(), end="")
