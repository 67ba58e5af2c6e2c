"""The model files users already have, next to the diffusers folder (docs/models.md, "Loading weights"):

* ``model.vae_file``: the Wan 2.1 VAE as one file (``wan_2.1_vae.safetensors``, ``Wan2.1_VAE.pth``; ``vae_file.py``);
* ``model.text_encoder_file``: UMT5 as one file (``umt5_xxl_fp16.safetensors``, ``models_t5_umt5-xxl-enc-bf16.pth``;
  ``text_file.py``);
* ``model.tokenizer_path``: a local tokenizer folder (``google/umt5-xxl``'s files, as the original repos ship it);
* ``model.high_noise_file`` / ``low_noise_file`` / ``transformer_file``: one file, or the original repos' folder of
  shards with its index (``high_noise_model/``; ``sharded.py``).

With all of them given, ``model.path`` is not needed. :func:`check_files` refuses a missing, partial or wrong file in
one line before anything loads (it reads headers and key names only); :func:`plan_lines` names what a run will load
from where (``wantrain check`` prints it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from wantrain.core.errors import UserError
from wantrain.models.wan22 import sharded

EXPERT_FILE_KEY = {"high_noise": "high_noise_file", "low_noise": "low_noise_file", None: "transformer_file"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")
_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def _path(model: Any, key: str) -> Path | None:
    value = getattr(model, key)
    return Path(value).expanduser() if value is not None else None


def expert_source(model: Any, expert: str | None) -> Path | None:
    return _path(model, EXPERT_FILE_KEY[expert])


def everything_from_files(model: Any) -> bool:
    """Every part the run needs is named by a file key (``model.path`` is then optional)."""
    parts = [model.vae_file, model.text_encoder_file, model.tokenizer_path]
    parts += [getattr(model, EXPERT_FILE_KEY[e]) for e in model.trained_experts]
    return all(p is not None for p in parts)


def check_files(model: Any, spec: Any) -> None:
    """One-line refusals for every file key of ``model`` that is set (headers and key names only)."""
    for expert in model.trained_experts:
        check_expert_source(model, expert)
    for key in ("vae_file", "text_encoder_file"):
        path = _path(model, key)
        if path is None:
            continue
        if not path.is_file():
            raise UserError(f"model.{key} '{path}' does not exist")
        if path.suffix not in _WEIGHT_SUFFIXES:
            raise UserError(f"model.{key} '{path}' is not a .safetensors or .pth file")
    vae = _path(model, "vae_file")
    if vae is not None:
        from wantrain.models.wan22.vae_file import check_vae_file

        check_vae_file(vae, latent_channels=spec.latent_channels)
    text = _path(model, "text_encoder_file")
    if text is not None:
        from wantrain.models.wan22.text_file import check_text_encoder_file

        check_text_encoder_file(text)
    tokenizer = _path(model, "tokenizer_path")
    if tokenizer is not None and not any((tokenizer / n).is_file() for n in TOKENIZER_FILES):
        raise UserError(f"model.tokenizer_path '{tokenizer}' is not a folder with tokenizer files "
                        f"({', '.join(TOKENIZER_FILES)}: the UMT5 tokenizer, as the original repo's google/umt5-xxl/)")


def check_expert_source(model: Any, expert: str | None) -> None:
    """Refuse ``expert``'s file key (``model.high_noise_file``, ...) when it is set and names neither a .safetensors
    file nor a complete folder of shards (headers and key names only). Unset: nothing to check."""
    source = expert_source(model, expert)
    if source is None:
        return
    key = EXPERT_FILE_KEY[expert]
    if source.is_dir():
        sharded.check_folder(source, key)
    elif not source.is_file():
        raise UserError(f"model.{key} '{source}' does not exist")
    elif source.suffix != ".safetensors":
        raise UserError(f"model.{key} '{source}' is not a .safetensors file or a folder of shards (only "
                        "safetensors are read; convert .pt/.ckpt first)")


def files_digest(model: Any) -> str:
    """Name, size and mtime of every encoder file the keys name (part of ``encoder_identity``); '' when none."""
    digest = hashlib.sha256()
    named = False
    for key in ("vae_file", "text_encoder_file", "tokenizer_path"):
        path = _path(model, key)
        if path is None:
            continue
        named = True
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            stat = file.stat()
            digest.update(f"{key}:{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16] if named else ""


def plan_lines(model: Any, spec: Any, *, random: bool) -> list[str]:
    """What the run loads from where, one line per part."""
    if random:
        return [f"all parts: the tiny random twin of {spec.name} (seed run.seed; no files)"]
    path = Path(model.path).expanduser() if model.path is not None else None
    lines = []
    for expert in model.trained_experts:
        source = expert_source(model, expert)
        name = {"high_noise": "high-noise expert", "low_noise": "low-noise expert"}.get(expert, "transformer")
        if source is None:
            folder = {"low_noise": "transformer_2"}.get(expert, "transformer")
            lines.append(f"{name}: {path / folder}/ (diffusers folder)")
        elif source.is_dir():
            lines.append(f"{name}: {source}/ (original-layout shards with their index)")
        else:
            lines.append(f"{name}: {source} (single file)")
    for part, key, folder in (("VAE", "vae_file", "vae"), ("text encoder", "text_encoder_file", "text_encoder"),
                              ("tokenizer", "tokenizer_path", "tokenizer")):
        source = _path(model, key)
        lines.append(f"{part}: {source} (model.{key})" if source is not None else f"{part}: {path / folder}/")
    return lines
