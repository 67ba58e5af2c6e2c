"""``wantrain convert``: a wantrain config from a musubi-tuner config (its training arguments as TOML, its dataset
TOML) or an ai-toolkit YAML, through the table of ``wantrain.app.migration`` (:data:`PEER_KEYS`, which
``docs/config.md`` renders), with a line for every key it did not map."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from wantrain.app.config import RunConfig
from wantrain.app.migration import (
    MUSUBI_PROMPT_DEFAULTS,
    NOT_NEEDED,
    PEER_KEYS,
    PEER_VALUES,
    PROMPT_NOT_MAPPED,
    PROMPT_OPTIONS,
    _assignments,
    _to,
)
from wantrain.core.config import key_places
from wantrain.core.errors import UserError

_YAML_FLOAT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")
_SAME_NAME = {"batch_size": "train.batch_size", "seed": "run.seed", "lr": "optimizer.lr"}
"""Peer keys named as a wantrain key of several tables: the one a peer's training config means."""



def _convert_key(key: str, value: Any, out: dict[str, Any], unmapped: list[str], places: dict[str, list[str]],
                 where: str) -> None:
    entry = PEER_KEYS.get(key)
    spelled = PEER_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    if spelled is not None:  # timestep_sampling = "shift": "sigmoid" (its shift is discrete_flow_shift's key)
        out.update(spelled.becomes)
        if not spelled.exact:
            unmapped.append(f"{where}{key} = {value!r}: converted to {_assignments(spelled.becomes)}; set "
                            f"{spelled.also}")
    elif entry is not None:
        found = (entry.convert or _to(entry.wantrain))(value)
        if not found:
            unmapped.append(f"{where}{key} = {value!r}: not converted; set {entry.wantrain} by hand"
                            + (f" ({entry.note})" if entry.note else ""))
        out.update(found)
    elif key in NOT_NEEDED:
        unmapped.append(f"{where}{key}: left out ({NOT_NEEDED[key][1]})")
    elif key in _SAME_NAME or len(places.get(key, [])) == 1:  # a wantrain key name (seed, lr): where it belongs
        out[_SAME_NAME.get(key) or places[key][0]] = value
    else:
        unmapped.append(f"{where}{key} = {value!r}: no wantrain key known for it")


def _dataset_tables(data: dict[str, Any], out: dict[str, Any], unmapped: list[str],
                    places: dict[str, list[str]]) -> list[dict[str, Any]]:
    """musubi-tuner's dataset TOML: ``[general]`` into ``out`` ([data] keys), each ``[[datasets]]`` table as a
    ``[[data.datasets]]`` table (its path, metadata, repeats; other keys into ``out`` too)."""
    for key, value in (data.get("general") or {}).items():
        _convert_key(key, value, out, unmapped, places, "[general] ")
    tables = []
    for i, t in enumerate(data.get("datasets") or []):
        entry: dict[str, Any] = {}
        for key, value in t.items():
            found: dict[str, Any] = {}
            _convert_key(key, value, found, unmapped, places, f"[[datasets]][{i}] ")
            for wkey, v in found.items():
                if wkey in ("data.path", "data.metadata", "data.repeats"):
                    entry[wkey.split(".")[1]] = v
                else:
                    out[wkey] = v
        tables.append(entry)
    for i, _ in enumerate(data.get("validation_datasets") or []):
        unmapped.append(f"[[validation_datasets]][{i}]: not converted; set [validation] path by hand")
    return tables


def prompt_file(path: Path, unmapped: list[str]) -> dict[str, Any]:
    """musubi-tuner's ``--sample_prompts`` text file (one prompt a line, ``--w 832 --h 480 --f 81 --s 20 --d 42
    --n negative`` options after it, ``#`` comments) as wantrain's ``[sample]`` table (``sample.prompts`` tables,
    nested form); an option it cannot map gets a line in ``unmapped``. A frame count not of the form 4k+1 is rounded
    down to one, as musubi-tuner does."""
    prompts: list[dict[str, Any]] = []
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        text, *options = line.split(" --")
        prompt: dict[str, Any] = {"prompt": text.strip()}
        for option in options:
            name, _, value = option.strip().partition(" ")
            value = value.strip()
            where = f"{Path(path).name} line {number}: --{name} {value}".rstrip()
            if name in PROMPT_OPTIONS:
                key, kind = PROMPT_OPTIONS[name]
                try:
                    prompt[key] = kind(value)
                except ValueError:
                    unmapped.append(f"{where}: not a {kind.__name__}; left out")
                    continue
                if key == "frames" and (prompt[key] - 1) % 4:
                    prompt[key] = max(1, (prompt[key] - 1) // 4 * 4 + 1)
                    unmapped.append(f"{where}: frames = {prompt[key]} (wantrain samples 4k+1 frames)")
            elif name:
                why = PROMPT_NOT_MAPPED.get(name, "no wantrain option known for it")
                unmapped.append(f"{where}: left out ({why})")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"'{path}' holds no prompt (one a line; '#' starts a comment); give musubi-tuner's "
                        "--sample_prompts file")
    section: dict[str, Any] = {"enabled": True}
    section.update({k: v for k, v in MUSUBI_PROMPT_DEFAULTS.items() if any(k not in p for p in prompts)})
    section["prompts"] = prompts
    return section


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        table = out
        for p in parents:
            table = table.setdefault(p, {})
        table[leaf] = value
    return out


def convert(path: Path, dataset: Path | None = None) -> tuple[dict[str, Any], list[str]]:
    """A wantrain config (nested, for ``tomli_w``) from a musubi-tuner config (training arguments as TOML, or its
    dataset TOML) or an ai-toolkit YAML, with ``dataset`` (musubi's dataset TOML) when given apart; and a line for
    every key not mapped. Values are converted where :data:`PEER_KEYS` says how (timesteps /1000, task names)."""
    places = key_places(RunConfig)
    flat: dict[str, Any] = {}
    unmapped: list[str] = []
    tables: list[dict[str, Any]] = []
    if Path(path).suffix == ".txt":  # musubi-tuner's --sample_prompts file
        return {"sample": prompt_file(path, unmapped)}, unmapped
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix in (".yaml", ".yml"):
        import yaml

        doc = yaml.safe_load(text) or {}
        processes = (doc.get("config") or {}).get("process") or [{}]

        def walk(table: dict[str, Any], where: str) -> None:
            for key, value in table.items():
                if isinstance(value, str) and _YAML_FLOAT.fullmatch(value):
                    value = float(value)  # PyYAML reads YAML 1.1: "1e-4" (no dot) is a string there
                if key == "datasets" and isinstance(value, list):
                    for i, d in enumerate(value):
                        walk(d, f"{where}datasets[{i}].")
                elif key == "sample" and isinstance(value, dict):
                    for k, v in value.items():  # ai-toolkit's sample table: steps, num_frames are sampling's
                        target = {"num_frames": "sample.frames", "steps": "sample.steps"}.get(k)
                        if target is not None:
                            flat[target] = v
                        else:
                            _convert_key(k, v, flat, unmapped, places, f"{where}sample.")
                elif isinstance(value, dict):
                    walk(value, f"{where}{key}.")
                elif key not in ("type", "name", "device") and not isinstance(value, list):
                    _convert_key(key, value, flat, unmapped, places, where)
                elif key == "name" and where == "":
                    flat["run.name"] = value
        walk({"name": (doc.get("config") or {}).get("name"), **processes[0]}, "")
        flat = {k: v for k, v in flat.items() if v is not None}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"'{path}' is neither TOML nor an ai-toolkit YAML (.yaml): {exc}") from None
        if "datasets" in data or "general" in data:
            tables = _dataset_tables(data, flat, unmapped, places)
        else:
            for key, value in data.items():
                if key not in ("dataset_config", "sample_prompts") or not isinstance(value, str):  # read below
                    _convert_key(key, value, flat, unmapped, places, "")
            named = data.get("sample_prompts")
            prompts = Path(path).parent / named if isinstance(named, str) else None
            if prompts is not None and prompts.is_file():
                flat.update({f"sample.{k}": v for k, v in prompt_file(prompts, unmapped).items()})
            elif prompts is not None:
                unmapped.append(f"sample_prompts '{named}': not found; convert it with "
                                "wantrain convert PROMPTS.txt")
            if isinstance(data.get("dataset_config"), str) and dataset is None:
                dataset = Path(path).parent / data["dataset_config"]
                if not dataset.is_file():
                    unmapped.append(f"dataset_config '{data['dataset_config']}': not found; pass --dataset")
                    dataset = None
    if dataset is not None:
        tables = _dataset_tables(tomllib.loads(Path(dataset).read_text(encoding="utf-8")), flat, unmapped, places)
    for key in ("lora.init_from", "data.path", "data.metadata", "data.repeats"):
        if len(tables) > 1 or key.startswith("lora"):
            continue
        if tables and key.split(".")[1] in tables[0]:
            flat[key] = tables[0][key.split(".")[1]]
    out = _nest(flat)
    if len(tables) > 1:
        out.setdefault("data", {})["datasets"] = tables
    return out, unmapped
