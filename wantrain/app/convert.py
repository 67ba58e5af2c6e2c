"""``wantrain convert``: a wantrain config from a peer's: musubi-tuner's training arguments (a TOML, or the
``accelerate launch ... wan_train_network.py ...`` command line its docs print) and its dataset TOML
(``wantrain.app.convert_musubi``), an ai-toolkit YAML job (``wantrain.app.convert_aitoolkit``), or musubi-tuner's
prompt file (``.txt``, the ``[sample]`` table). Every peer key is mapped or named in a line; a file it cannot read
(malformed TOML or YAML, a diffusion-pipe config) is refused in one line (:class:`UserError`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from wantrain.app.conversion import Conversion
from wantrain.app.migration import MUSUBI_PROMPT_DEFAULTS, PROMPT_NOT_MAPPED, PROMPT_OPTIONS
from wantrain.core.errors import UserError

DIFFUSION_PIPE = ("is a diffusion-pipe config ({what}); wantrain convert does not read diffusion-pipe's format: start "
                  "from examples/quickstart.toml and set its keys by hand (docs/config.md, Coming from another "
                  "trainer)")


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


def _diffusion_pipe(data: dict[str, Any]) -> str | None:
    """What marks ``data`` as diffusion-pipe's (its run config: ``[model] type``, ``micro_batch_size_per_gpu``,
    ``pipeline_stages``; its dataset config: ``[[directory]]``), or ``None``."""
    if isinstance(data.get("directory"), list):
        return "[[directory]] tables"
    marks = [k for k in ("micro_batch_size_per_gpu", "pipeline_stages", "dataset") if k in data]
    if marks or (isinstance(data.get("model"), dict) and "type" in data["model"] and "adapter" in data):
        return ", ".join(marks or ["[model] type", "[adapter]"])
    return None


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"'{path}' is not UTF-8 text; give a musubi-tuner .toml or command line, or an ai-toolkit "
                        ".yaml") from None


def _toml(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"'{path}' is not valid TOML ({exc}); give a musubi-tuner .toml, its command line, or an "
                        "ai-toolkit .yaml") from None


def convert(path: Path, dataset: Path | None = None) -> Conversion:
    """Read the peer's file at ``path`` (and musubi-tuner's dataset TOML ``dataset`` when given apart) into a
    :class:`Conversion` (``.config()`` is the wantrain config, ``.unmapped`` a line per key not mapped,
    ``.defaults`` a line per peer default written out)."""
    from wantrain.app import convert_aitoolkit, convert_musubi

    path = Path(path)
    c = Conversion()
    text = _read(path)
    args = convert_musubi.command_line(text)
    if args is not None:
        dataset = convert_musubi.training_arguments(args, c, path.parent, dataset, "--")
    elif path.suffix == ".txt":  # musubi-tuner's --sample_prompts file
        c.flat.update({f"sample.{k}": v for k, v in prompt_file(path, c.unmapped).items()})
        return c
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise UserError(f"'{path}' is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
        convert_aitoolkit.convert_yaml(doc, c)
    else:
        data = _toml(path, text)
        what = _diffusion_pipe(data)
        if what is not None:
            raise UserError(f"'{path}' " + DIFFUSION_PIPE.format(what=what))
        if "datasets" in data or "general" in data:
            convert_musubi.dataset_tables(data, c)
        else:
            dataset = convert_musubi.training_arguments(data, c, path.parent, dataset, "")
    if dataset is not None:
        data = _toml(Path(dataset), _read(Path(dataset)))
        what = _diffusion_pipe(data)
        if what is not None:
            raise UserError(f"'{dataset}' " + DIFFUSION_PIPE.format(what=what))
        convert_musubi.dataset_tables(data, c)
    return c
