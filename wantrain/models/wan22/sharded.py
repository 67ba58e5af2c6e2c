"""An expert shipped as a folder of safetensors shards with an index, as the original Wan 2.2 repos ship
``high_noise_model/`` and ``low_noise_model/`` (``diffusion_pytorch_model-0000N-of-0000M.safetensors`` and
``diffusion_pytorch_model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard), in the original
Wan key names. ``model.high_noise_file`` / ``low_noise_file`` / ``transformer_file`` may name such a folder instead
of a single file; a folder with one unsharded ``*.safetensors`` and no index works too.

A partial download is refused in one line naming the first missing shard (or tensor) and how many are missing.
The shards are streamed tensor by tensor into the storage dtype (:class:`ShardReader`, through the single-file
loader's loop): the folder is never read whole, nor held in another dtype than the one it trains in. A diffusers
folder (``transformer/``: diffusers names, same shard layout) streams the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def shard_files(folder: Path) -> list[Path]:
    """The folder's shards in index order (a complete folder: :func:`check_folder` first)."""
    index = index_file(folder)
    if index is None:
        return sorted(folder.glob("*.safetensors"))
    return [folder / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


class ShardReader:
    """The tensors of a folder of shards by name, for ``single_file.load_transformer(reader=...)``: at most one
    shard is open at a time (each through ``single_file._Reader``, which reopens its file every 256 MiB read so that
    the mapping's pages do not pile up), so streaming the folder in shard order holds one tensor and a bounded
    window of one shard's pages besides the model. Entering it checks the folder (index, shards present, every
    indexed tensor in a shard's header) in one line per problem, reading headers only."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder = Path(folder)
        self.key = key
        self._where: dict[str, Path] = {}
        self._open_shard: Path | None = None
        self._reader: Any = None

    def __enter__(self) -> ShardReader:
        from safetensors import SafetensorError, safe_open

        check_folder(self.folder, self.key)
        for shard in shard_files(self.folder):
            try:
                with safe_open(str(shard), framework="pt") as fh:
                    self._where.update(dict.fromkeys(fh.keys(), shard))
            except (SafetensorError, OSError) as exc:
                raise UserError(f"model.{self.key} '{self.folder}': shard {shard.name} is not a readable "
                                f"safetensors file ({exc})") from None
        index = index_file(self.folder)
        if index is not None:
            absent = sorted(set(json.loads(index.read_text())["weight_map"]) - set(self._where))
            if absent:
                raise UserError(f"model.{self.key} '{self.folder}': {len(absent)} tensors named in {index.name} are "
                                f"in none of the shards, first {absent[0]} (a shard is truncated or from another "
                                "download)")
        return self

    def __exit__(self, *exc: object) -> None:
        self._switch(None)

    def _switch(self, shard: Path | None) -> Any:
        from wantrain.models.wan22.single_file import _Reader

        if shard != self._open_shard:
            if self._reader is not None:
                self._reader.__exit__(None, None, None)
            self._reader = _Reader(shard).__enter__() if shard is not None else None
            self._open_shard = shard
        return self._reader

    def keys(self) -> list[str]:
        return list(self._where)  # shard by shard

    def shape_and_dtype(self, key: str) -> tuple[list[int], str]:
        return self._switch(self._where[key]).shape_and_dtype(key)

    def get(self, key: str) -> torch.Tensor:
        return self._switch(self._where[key]).get(key)


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
