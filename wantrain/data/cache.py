"""On-disk cache of VAE latents and text embeddings (safetensors, one file per clip / per caption).

Layout, per cache folder (``[data] cache_dir``, else ``<dataset>/.wantrain_cache``)::

    latents/<key>.safetensors   every tensor ``encode_media`` returned for one clip (batch dim removed)
    text/<key>.safetensors      every tensor ``encode_text`` returned for one caption (batch dim removed)
    verified.json               real frame counts found by decoding, by content fingerprint

A latent key hashes the file's content fingerprint (size, mtime, sampled blocks), everything that shapes the
clip's pixels (start, frames, source and target fps, bucket size, resize version) and ``encoder_identity``. A text
key hashes the caption and :func:`text_identity` (which adds the text encoder's dtype, text length and prompt
cleaning). Changing one processing parameter therefore misses exactly the entries it affects. Every write goes
through ``core.atomic.atomic_write`` (a temporary file in the same folder, fsync'ed, renamed into place), so a killed
run never leaves a half-written entry and two processes filling one cache never see one; ``verified.json`` is
updated under an OS lock. A folder that cannot be written is one line naming it (``StorageError``).
:func:`find_orphans` lists entries no current clip or caption uses (they may be another config's: every config
on one data folder shares its cache); :func:`remove_orphans` deletes them (``wantrain cache --prune``).

This module owns the storage (keys, files, orphans) and knows nothing of datasets; ``training.py`` fills it
(``TrainingData.fill_cache``, :func:`wantrain.data.training.ensure_cache`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from wantrain.core.atomic import atomic_write, storage_error
from wantrain.core.errors import UserError

FORMAT_VERSION = 1
CACHE_DIRNAME = ".wantrain_cache"
# A temporary file untouched this long is a killed writer's; younger ones may be another process's write in flight.
STALE_TMP_SECONDS = 24 * 3600
CACHE_HINT = "free space there, or set data.cache_dir to a writable folder with room"


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:40]


def latent_key(params: dict[str, Any], encoder_identity: str) -> str:
    return _digest({"format": FORMAT_VERSION, "kind": "latents", "encoder": encoder_identity, **params})


def text_key(caption: str, text_identity: str) -> str:
    return _digest({"format": FORMAT_VERSION, "kind": "text", "encoder": text_identity, "caption": caption})


def text_identity(encoders: Any) -> str:
    """What text entries are keyed on: ``encoders.text_identity`` (the text encoder with everything that changes
    its output: dtype, text length, prompt cleaning) when the encoders have one, else ``encoder_identity``."""
    return getattr(encoders, "text_identity", None) or encoders.encoder_identity


def entry_path(cache_dir: Path, kind: str, key: str) -> Path:
    return cache_dir / kind / f"{key}.safetensors"


def save_entry(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one entry whole or not at all (``core.atomic.atomic_write``). Two processes filling the same cache
    write the same entry through two temporary files; the second rename replaces an identical file. A folder that
    cannot be written is one line (``StorageError``) naming it and the ``data.cache_dir`` way out."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error("the cache folder", path.parent, exc, hint=CACHE_HINT) from exc
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), what="cache entry",
                 hint=CACHE_HINT)


def load_entry(path: Path) -> dict[str, torch.Tensor] | None:
    """The tensors of one entry, or None when it is missing or unreadable (then it is re-encoded)."""
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError):
        return None


def split_batch(out: dict[str, torch.Tensor], n: int, who: str) -> list[dict[str, torch.Tensor]]:
    """Per-sample dicts from an encoder's batched output (every tensor's dim 0 must be ``n``)."""
    for k, v in out.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"{who} returned {k!r} with shape {shape}; every value must be a tensor with dim 0 = {n}")
    return [{k: v[i] for k, v in out.items()} for i in range(n)]


def check_writable(cache_dir: Path, key: str | None) -> None:
    """Refuse, in one line, a cache folder that cannot be written (under /proc, below a file, read-only) before
    anything is written or loaded: a probe file in it, or in its nearest existing parent, made and removed at once.
    ``key`` is the config key that named it (``None``: the default next to the data)."""
    base = cache_dir
    while not base.exists() and base != base.parent:
        base = base.parent
    why = f"'{base}' is a file, not a folder" if not base.is_dir() else None
    if why is None:
        try:
            fd, probe = tempfile.mkstemp(prefix=".wantrain_probe.", dir=base)
        except OSError as exc:
            why = f"{exc.strerror or exc} in '{base}'"
        else:
            os.close(fd)
            os.unlink(probe)
    if why is not None:
        what = f"{key} '{cache_dir}'" if key else f"the cache folder '{cache_dir}' (next to the data)"
        raise UserError(f"{what} cannot be written ({why}); set data.cache_dir to a folder you can write")


def read_verified(cache_dir: Path) -> dict[str, int]:
    try:
        data = json.loads((cache_dir / "verified.json").read_text())
        return {str(k): int(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def write_verified(cache_dir: Path, fingerprint: str, frames: int) -> None:
    """Add one clip's real frame count to ``verified.json``. The read, update and write happen under an OS lock on
    ``cache_dir/.lock``, so two processes verifying clips into one cache do not drop each other's counts."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(cache_dir / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise storage_error("the cache folder", cache_dir, exc, hint=CACHE_HINT) from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_verified(cache_dir)
        data[fingerprint] = frames
        atomic_write(cache_dir / "verified.json", json.dumps(data, sort_keys=True), what="cache file",
                     hint=CACHE_HINT)
    finally:
        os.close(lock)  # releases the lock


@attrs.frozen
class CacheStats:
    """What :func:`wantrain.data.ensure_cache` did."""

    latents_hit: int
    latents_encoded: int
    texts_hit: int
    texts_encoded: int
    orphans_removed: int
    clips_failed: int  # clips that could not be decoded (now in the report's verification list)
    orphans: tuple[Path, ...] = ()  # entries no clip or caption of this config uses (found, removed or not)

    @property
    def hits(self) -> int:
        return self.latents_hit + self.texts_hit

    @property
    def encoded(self) -> int:
        return self.latents_encoded + self.texts_encoded

    def format(self) -> str:
        return (f"cache: {self.latents_hit} latents and {self.texts_hit} text embeddings already cached, "
                f"{self.latents_encoded} latents and {self.texts_encoded} text embeddings encoded, "
                f"{self.clips_failed} clips failed to decode")


def find_orphans(expected: dict[Path, set[Path]], *, now: float | None = None) -> list[Path]:
    """Entries in the ``latents``/``text`` folders of each cache folder that are not in ``expected[cache_dir]``,
    and temporary files older than :data:`STALE_TMP_SECONDS` (a killed writer's). Younger temporary files may belong
    to a run writing right now (``wantrain run`` encodes on first use): deleting one would fail that writer's rename.
    Other configs on the same data share its cache folder: an entry this config does not use may be theirs."""
    now = time.time() if now is None else now
    found = []
    for cache_dir, keep in expected.items():
        for kind in ("latents", "text"):
            folder = cache_dir / kind
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                if not f.is_file() or f in keep:
                    continue
                try:
                    orphan = f.suffix == ".safetensors" or (
                        (f.suffix == ".tmp" or ".tmp-" in f.name) and now - f.stat().st_mtime > STALE_TMP_SECONDS)
                except FileNotFoundError:  # renamed into place by its writer meanwhile
                    continue
                if orphan:
                    found.append(f)
    return found


def remove_entries(paths: list[Path] | tuple[Path, ...]) -> int:
    """Delete these cache files (those :func:`find_orphans` found); returns how many were still there."""
    removed = 0
    for f in paths:
        try:
            f.unlink()
        except FileNotFoundError:
            continue
        removed += 1
    return removed


def remove_orphans(expected: dict[Path, set[Path]], *, now: float | None = None) -> int:
    """Delete what :func:`find_orphans` finds; returns how many files were deleted."""
    return remove_entries(find_orphans(expected, now=now))


def describe_entries(paths: list[Path] | tuple[Path, ...]) -> str:
    """``"12 latents and 3 text embeddings (4.1 MB) in /data/.wantrain_cache"`` for a list of cache files."""
    size, kinds, folders = 0, {"latents": 0, "text": 0}, []
    for f in paths:
        with contextlib.suppress(FileNotFoundError):
            size += f.stat().st_size
        kinds[f.parent.name] = kinds.get(f.parent.name, 0) + 1
        if str(f.parent.parent) not in folders:
            folders.append(str(f.parent.parent))
    return (f"{kinds['latents']} latents and {kinds['text']} text embeddings ({size / 1e6:.1f} MB) in "
            f"{', '.join(folders)}")
