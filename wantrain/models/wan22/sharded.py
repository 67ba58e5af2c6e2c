"""An expert shipped as a folder of safetensors shards with an index, as the original Wan 2.2 repos ship
``high_noise_model/`` and ``low_noise_model/`` (``diffusion_pytorch_model-0000N-of-0000M.safetensors`` and
``diffusion_pytorch_model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard), in the original
Wan key names. ``model.high_noise_file`` / ``low_noise_file`` / ``transformer_file`` may name such a folder instead
of a single file; a folder with one unsharded ``*.safetensors`` and no index works too.

A partial download is refused in one line naming the first missing shard (or tensor) and how many are missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from wantrain.core.errors import UserError


def index_file(folder: Path) -> Path | None:
    found = sorted(folder.glob("*.safetensors.index.json"))
    return found[0] if found else None


def check_folder(folder: Path, key: str) -> None:
    """Refuse a folder that is not a complete sharded (or single-file) checkpoint, reading only the index and the
    file names."""
    index = index_file(folder)
    if index is None:
        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise UserError(f"model.{key} '{folder}' is a folder without a *.safetensors.index.json and with "
                            f"{len(files)} .safetensors files; give the expert's folder of shards with its index, or "
                            "one .safetensors file")
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"model.{key} '{folder}': {index.name} is not a readable shard index ({exc})") from None
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise UserError(f"model.{key} '{folder}' is incomplete: {len(missing)} of {len(shards)} shards named in "
                        f"{index.name} are missing, first {missing[0]} (finish the download)")


def read_folder(folder: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's shards, checked against the index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_folder(folder, key)
    index = index_file(folder)
    if index is None:
        files = sorted(folder.glob("*.safetensors"))
        return load_file(str(files[0]))
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        try:
            state.update(load_file(str(folder / shard)))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"model.{key} '{folder}': shard {shard} is not a readable safetensors file ({exc})"
                            ) from None
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise UserError(f"model.{key} '{folder}': {len(absent)} tensors named in {index.name} are in none of the "
                        f"shards, first {absent[0]} (a shard is truncated or from another download)")
    return state


def tensor_names(path: Path, key: str) -> list[str]:
    """The tensor names of a single file or a sharded folder, from the headers only (nothing is loaded)."""
    from safetensors import SafetensorError, safe_open

    if path.is_dir():
        check_folder(path, key)
        index = index_file(path)
        if index is not None:
            return sorted(json.loads(index.read_text())["weight_map"])
        path = sorted(path.glob("*.safetensors"))[0]
    try:
        with safe_open(str(path), framework="pt") as fh:
            return list(fh.keys())
    except (SafetensorError, OSError) as exc:
        raise UserError(f"model.{key} '{path}' is not a readable safetensors file ({exc})") from None
