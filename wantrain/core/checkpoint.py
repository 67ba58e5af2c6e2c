"""Checkpoints: one directory per saved step holding everything a run needs to continue bitwise.

A checkpoint is written by the core (``Trainer`` at each save) from the trainer's state tree
(:meth:`wantrain.core.loop.Trainer.state_dict`): LoRA weights, optimizer and scheduler state, every random stream,
the data position, the core's counters and pending log-interval sums, and each observer's state. Layout::

    <run_dir>/checkpoints/step_000200/
        state.json            the tree, tensors replaced by references into tensors.safetensors
        tensors.safetensors   every tensor of the tree (CPU copies)
        <observer sidecars>   files observers write beside the checkpoint (``write_sidecars``)
        complete.json         the completion marker, written last: step, file sizes, wantrain version

Guarantees (each tested in ``tests/core/test_checkpoint.py``):

* **Atomic.** Everything is written into a temporary sibling directory, each file fsync'ed, then the directory is
  renamed into place and its parent fsync'ed. A checkpoint directory without ``complete.json``, or whose files do
  not have the sizes the marker lists, is *torn* and never used; :func:`list_checkpoints` reports it.
* **No pickle.** Tensors go to safetensors, everything else to JSON (``torch.load`` is never used).
* **Disk errors are one line.** Running out of space or permission raises :class:`CheckpointWriteError` (a
  ``UserError``) naming the directory; the partial files are removed and earlier checkpoints are untouched.
* **Retention never tears.** Pruned checkpoints are first renamed out of the ``step_*`` namespace, then removed, so
  a kill during pruning leaves no half-deleted checkpoint that looks complete. LoRA files in the run directory are
  never touched by retention; an observer's sidecars live inside the checkpoint directory and go with it.

Tree encoding (``state.json``): dicts with string keys stay dicts; dicts with other keys become
``{"__items__": [[key, value], ...]}``; tuples ``{"__tuple__": [...]}``; tensors ``{"__tensor__": name}``. Anything
else must be a JSON scalar or list; other types are a bug in whoever contributed them and raise ``TypeError``
naming their path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.errors import UserError
from wantrain.core.version import __version__

FORMAT_VERSION = 1
MARKER = "complete.json"
STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointWriteError(UserError):
    """A checkpoint (or LoRA file) could not be written: disk full, no permission, read-only file system."""


class CheckpointReadError(UserError):
    """A checkpoint cannot be used: torn, unreadable, or from an incompatible wantrain version."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# -- the tree <-> (JSON, tensors) ----------------------------------------------------------------------------------
def split_tree(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` as JSON-ready data plus the tensors it referenced (CPU copies, contiguous, detached)."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = path or "tensor"
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):
                return {k: enc(v, f"{path}/{k}" if path else k) for k, v in value.items()}
            return {"__items__": [[enc(k, f"{path}/key{i}"), enc(v, f"{path}/{k}")]
                                  for i, (k, v) in enumerate(value.items())]}
        if isinstance(value, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value  # json writes inf/nan as Infinity/NaN and reads them back
        raise TypeError(f"checkpoint state at '{path}' is a {type(value).__name__}; only tensors, dicts, lists, "
                        "tuples, str, int, float, bool and None can be saved")

    return enc(tree, ""), tensors


def join_tree(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tree`."""
    if isinstance(data, dict):
        if "__tensor__" in data and len(data) == 1:
            return tensors[data["__tensor__"]]
        if "__items__" in data and len(data) == 1:
            return {join_tree(k, tensors): join_tree(v, tensors) for k, v in data["__items__"]}
        if "__tuple__" in data and len(data) == 1:
            return tuple(join_tree(v, tensors) for v in data["__tuple__"])
        return {k: join_tree(v, tensors) for k, v in data.items()}
    if isinstance(data, list):
        return [join_tree(v, tensors) for v in data]
    return data


def copy_tree(tree: Any) -> Any:
    """A deep copy whose tensors are independent clones on their own device (an in-memory snapshot)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(copy_tree(v) for v in tree)
    if isinstance(tree, list):
        return [copy_tree(v) for v in tree]
    return tree


# -- writing -------------------------------------------------------------------------------------------------------
def canonicalize_safetensors(path: Path) -> None:
    """Rewrite the JSON header of the safetensors file ``path`` with sorted keys.

    safetensors writes its header from a hash map whose order changes from process to process, so the same tensors
    and metadata give different bytes in two runs. Sorted, identical training gives identical files (what the resume
    tests compare, and what users comparing checksums expect). Loaders do not depend on the order.
    """
    with open(path, "r+b") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
        if len(text) == length:
            fh.seek(8)
            fh.write(text)
            return
        fh.seek(8 + length)
        data = fh.read()
        fh.seek(0)
        fh.write(struct.pack("<Q", len(text)) + text + data)
        fh.truncate()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # some file systems cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def disk_error_line(what: str, path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    return (f"cannot write {what} '{path}': {reason}; free space or fix permissions there "
            "(earlier checkpoints and LoRA files are intact; resume with --resume auto)")


def write_checkpoint(
    directory: Path,
    step: int,
    tree: Any,
    *,
    meta: dict[str, Any] | None = None,
    sidecars: Iterable[Callable[[Path, str], None]] = (),
) -> Path:
    """Write ``tree`` as checkpoint ``directory/step_NNNNNN`` atomically and return its path.

    ``meta`` is stored in ``state.json`` beside the tree (config hash, resolved config, reason). Each
    ``sidecars`` callable is called as ``fn(tmp_dir, stem)`` and may write files into ``tmp_dir`` (the checkpoint's
    temporary directory); ``stem`` is the checkpoint's name (``step_000200``). An existing checkpoint of the same
    step is replaced only once the new one is complete.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    name = step_dir_name(step)
    final = directory / name
    tmp = directory / f".{name}.tmp-{os.getpid()}"
    data, tensors = split_tree(tree)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_tree(tmp)
        tmp.mkdir()
        save_file(tensors, str(tmp / TENSOR_FILE), metadata={"format": "pt"})
        canonicalize_safetensors(tmp / TENSOR_FILE)
        state = {"format": FORMAT_VERSION, "step": step, "meta": meta or {}, "tree": data}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
        for write in sidecars:
            write(tmp, name)
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        for f in sizes:
            _fsync_file(tmp / f)
        marker = {"step": step, "files": sizes, "wantrain_version": __version__, "time": time.time(),
                  "format": FORMAT_VERSION}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        _fsync_file(tmp / MARKER)
        _fsync_dir(tmp)
        if final.exists():  # the same step again (a resumed run passing a save point): swap, never tear
            old = directory / f".{name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            _remove_tree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as exc:
        _remove_tree(tmp)
        raise CheckpointWriteError(disk_error_line("checkpoint", final, exc)) from exc
    finally:
        if tmp.exists():
            _remove_tree(tmp)
    return final


# -- reading ---------------------------------------------------------------------------------------------------------
@attrs.frozen
class CheckpointInfo:
    """A checkpoint directory found on disk. ``problem`` is None for a complete one, else why it is torn."""

    path: Path
    step: int
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.problem is None


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Whether ``path`` is a complete checkpoint (marker present, files of the listed sizes)."""
    path = Path(path)
    match = _STEP_DIR.match(path.name)
    step = int(match.group(1)) if match else -1
    marker = path / MARKER
    if not marker.is_file():
        return CheckpointInfo(path, step, "no completion marker (the save was interrupted)")
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        files = dict(info["files"])
        step = int(info["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return CheckpointInfo(path, step, "unreadable completion marker")
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return CheckpointInfo(path, step, f"file '{name}' is missing or has the wrong size")
    return CheckpointInfo(path, step)


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """Every ``step_*`` directory under ``directory`` (complete or torn), oldest step first. Temporary
    directories of interrupted saves (``.step_*.tmp-*``) are reported as torn too."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if not p.is_dir():
            continue
        if _STEP_DIR.match(p.name):
            found.append(inspect_checkpoint(p))
        elif p.name.startswith(".step_") and ".tmp-" in p.name:
            m = re.match(r"^\.step_(\d+)\.tmp-", p.name)
            found.append(CheckpointInfo(p, int(m.group(1)) if m else -1, "temporary directory of an interrupted save"))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def latest_complete(directory: Path) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """(The complete checkpoint with the highest step, the torn ones newer than it)."""
    found = list_checkpoints(directory)
    complete = [c for c in found if c.complete]
    best = complete[-1] if complete else None
    torn = [c for c in found if not c.complete and (best is None or c.step >= best.step)]
    return best, torn


@attrs.frozen
class LoadedCheckpoint:
    path: Path
    step: int
    tree: Any
    meta: dict[str, Any]


def read_checkpoint(path: Path) -> LoadedCheckpoint:
    """Load a complete checkpoint (tensors on the CPU). Raises :class:`CheckpointReadError` with one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    info = inspect_checkpoint(path)
    if not info.complete:
        raise CheckpointReadError(f"checkpoint '{path}' cannot be used: {info.problem}")
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(Path(path) / TENSOR_FILE), device="cpu")
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointReadError(f"checkpoint '{path}' is unreadable: {exc}") from None
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointReadError(
            f"checkpoint '{path}' has format {state.get('format')!r}; this wantrain reads format {FORMAT_VERSION}"
        )
    return LoadedCheckpoint(Path(path), int(state["step"]), join_tree(state["tree"], tensors), state.get("meta", {}))


# -- retention -------------------------------------------------------------------------------------------------------
def prune(directory: Path, *, keep_last: int | None, keep_every: int | None, protect: Iterable[int] = ()) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep_last`` (None keeps all), except those whose step is a
    multiple of ``keep_every`` and those in ``protect``. Stale temporary directories of this process's earlier
    saves and of dead processes are removed too. Returns the removed paths."""
    directory = Path(directory)
    complete = [c for c in list_checkpoints(directory) if c.complete]
    keep = {c.step for c in complete[-keep_last:]} if keep_last else {c.step for c in complete}
    if keep_every:
        keep |= {c.step for c in complete if c.step % keep_every == 0}
    keep |= set(protect)
    removed = []
    for c in complete:
        if c.step in keep:
            continue
        doomed = directory / f".{c.path.name}.deleting-{os.getpid()}"
        try:
            os.replace(c.path, doomed)  # leave the step_* namespace first: never a half-deleted "complete" one
        except OSError:
            continue
        _remove_tree(doomed)
        removed.append(c.path)
    for p in directory.iterdir() if directory.is_dir() else ():
        if p.name.startswith(".step_") and (".deleting-" in p.name or ".old-" in p.name):
            _remove_tree(p)
    return removed


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporary directories left by interrupted saves (call once a run owns the directory)."""
    removed = []
    if Path(directory).is_dir():
        for p in Path(directory).iterdir():
            if p.name.startswith(".step_") and any(s in p.name for s in (".tmp-", ".deleting-", ".old-")):
                _remove_tree(p)
                removed.append(p)
    return removed
