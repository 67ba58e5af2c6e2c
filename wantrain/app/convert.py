"""``wantrain convert``: a wantrain config from a peer's: musubi-tuner's training arguments (a TOML, or the
``accelerate launch ... wan_train_network.py ...`` command line its docs print) and its dataset TOML
(``wantrain.app.convert_musubi``), an ai-toolkit YAML job (``wantrain.app.convert_aitoolkit``), or musubi-tuner's
prompt file (``.txt``, the ``[sample]`` table). Every peer key is mapped or named in a line; a file it cannot read
(malformed TOML or YAML, a diffusion-pipe config) is refused in one line (:class:`UserError`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from wantrain.app import convert_aitoolkit, convert_musubi
from wantrain.app.conversion import Conversion
from wantrain.app.convert_musubi import prompt_file
from wantrain.app.migration import DOCS
from wantrain.core.errors import UserError

__all__ = ["Conversion", "convert", "prompt_file"]

DIFFUSION_PIPE = ("is a diffusion-pipe config ({what}); wantrain convert does not read diffusion-pipe's format: start "
                  f"from examples/quickstart.toml and set its keys by hand ({DOCS})")


DIFFUSION_PIPE_KEYS = {
    "output_dir": "run.output_dir", "epochs": "train.max_epochs", "max_steps": "train.max_steps",
    "micro_batch_size_per_gpu": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.clip_grad_norm", "warmup_steps": "lr_scheduler.warmup_steps",
    "lr_scheduler": "lr_scheduler.type", "blocks_to_swap": "model.blocks_to_swap",
    "save_every_n_epochs": "train.save_every_epochs", "save_every_n_steps": "train.save_every",
    "activation_checkpointing": "model.gradient_checkpointing", "model.ckpt_path": "model.path (a diffusers folder)",
    "model.timestep_sample_method": "model.timestep_sampling", "adapter.rank": "lora.rank",
    "adapter.init_from_existing": "lora.init_from", "optimizer.lr": "optimizer.lr",
    "optimizer.weight_decay": "optimizer.weight_decay", "resolutions": "data.resolutions (the same area budgets)",
    "frame_buckets": "data.frames", "directory.path": "data.path or [[data.datasets]] path",
    "directory.num_repeats": "data.repeats",
}
"""diffusion-pipe's keys (run and dataset config; ``table.key`` inside a table) -> wantrain's, named in the
refusal so that the keys can be set by hand."""


def _diffusion_pipe_keys(data: dict[str, Any]) -> str:
    names = []
    for key, value in data.items():
        tables = [value] if isinstance(value, dict) else [v for v in value if isinstance(v, dict)] \
            if isinstance(value, list) else []
        names += [f"{key}.{k}" for t in tables for k in t] if tables else [key]
    known = [f"{n} -> {DIFFUSION_PIPE_KEYS[n]}" for n in dict.fromkeys(names) if n in DIFFUSION_PIPE_KEYS]
    return f"; its keys go to: {', '.join(known)}" if known else ""


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
            raise UserError(f"'{path}' " + DIFFUSION_PIPE.format(what=what) + _diffusion_pipe_keys(data))
        if "datasets" in data or "general" in data:
            convert_musubi.dataset_tables(data, c)
        else:
            dataset = convert_musubi.training_arguments(data, c, path.parent, dataset, "")
    if dataset is not None:
        data = _toml(Path(dataset), _read(Path(dataset)))
        what = _diffusion_pipe(data)
        if what is not None:
            raise UserError(f"'{dataset}' " + DIFFUSION_PIPE.format(what=what) + _diffusion_pipe_keys(data))
        convert_musubi.dataset_tables(data, c)
    return c
