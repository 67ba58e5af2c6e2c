"""Checkpoints: one directory per saved step holding everything a run needs to continue bitwise.

A checkpoint is written by the core (``Trainer`` at each save) from the trainer's state tree
(:meth:`wantrain.core.loop.Trainer.state_dict`): LoRA weights, optimizer and scheduler state, every random stream,
the data position, the core's counters and pending log-interval sums, and each observer's state. Layout::

    <run_dir>/checkpoints/step_000200/
        state.json            the tree, tensors replaced by references into tensors.safetensors
        tensors.safetensors   every tensor of the tree (CPU copies)
        <observer sidecars>   files observers write beside the checkpoint (``write_sidecars``)
        complete.json         the completion marker, written last: step, each file's size and sha256, version

Guarantees (each tested in ``tests/core/test_checkpoint.py``):

* **Atomic.** Everything is written into a temporary sibling directory, each file fsync'ed, then the directory is
  renamed into place and its parent fsync'ed. A checkpoint directory without ``complete.json``, or whose files do
  not have the sizes the marker lists, is *torn* and never used; :func:`list_checkpoints` reports it.
* **Damage is found, never loaded.** The marker holds each file's sha256; :func:`read_checkpoint` recomputes them
  (:func:`verify_checkpoint`) and checks that the tensors file holds exactly the tensors ``state.json`` references,
  each of the dtype and shape recorded there, before anything is parsed into a tree. A mismatch raises
  :class:`CheckpointDamaged` (one line naming the checkpoint, the file or tensor, and what is wrong). Cost: one
  read of every file at write and at read time (sha256 runs at ~1.3 GiB/s with SHA-NI; docs/resume.md).
* **No pickle.** Tensors go to safetensors, everything else to JSON (``torch.load`` is never used).
* **Disk errors are one line.** Running out of space or permission raises :class:`CheckpointWriteError` (a
  ``UserError``) naming the directory; the partial files are removed and earlier checkpoints are untouched.
* **Retention never tears.** Pruned checkpoints are first renamed out of the ``step_*`` namespace, then removed, so
  a kill during pruning leaves no half-deleted checkpoint that looks complete. LoRA files in the run directory are
  never touched by retention; an observer's sidecars live inside the checkpoint directory and go with it.

Tree encoding (``state.json``): dicts with string keys stay dicts; dicts with other keys become
``{"__items__": [[key, value], ...]}``; tuples ``{"__tuple__": [...]}``; tensors ``{"__tensor__": name, "dtype":
"float32", "shape": [8, 24]}`` (dtype and shape as written, checked on read; references without them, from older
checkpoints, are checked for presence only). Anything
else must be a JSON scalar or list; other types are a bug in whoever contributed them and raise ``TypeError``
naming their path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.atomic import (
    StorageError,
    critical_section,
    fsync_dir,
    fsync_file,
    is_storage_error,
    storage_error,
)
from wantrain.core.errors import UserError
from wantrain.core.version import __version__

FORMAT_VERSION = 1
MARKER = "complete.json"
STATE_FILE = "state.json"
ANNOUNCED = "announced"  # an empty file the core adds once the checkpoint's CheckpointSaved event was delivered
TENSOR_FILE = "tensors.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_ROTATED = re.compile(r"^\.(step_\d{6,})\.old-\d+$")  # a checkpoint being replaced by one of the same step
CHECKSUM = "sha256"  # the marker's key and the hashlib algorithm (see the module docstring for the cost)


class CheckpointWriteError(StorageError):
    """A checkpoint (or LoRA file) could not be written: disk full, no permission, read-only file system."""


class CheckpointReadError(UserError):
    """A checkpoint cannot be used: torn, unreadable, or from an incompatible wantrain version."""


class CheckpointDamaged(CheckpointReadError):
    """A checkpoint's files are not what was written: a checksum, a tensor's dtype or shape, a missing tensor, a
    state tree that does not match the schema. ``--resume auto`` passes over it to an older one."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"checkpoint '{path}' is damaged: {problem}; resume from an earlier checkpoint "
                         "(--resume auto does) or start a new run")
        self.path = Path(path)
        self.problem = problem


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
            return {"__tensor__": name, "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (how references and messages name dtypes)."""
    return str(dtype).removeprefix("torch.")


def _is_reference(data: dict) -> bool:
    return "__tensor__" in data and set(data) <= {"__tensor__", "dtype", "shape"}


def tensor_references(data: Any) -> Iterator[dict[str, Any]]:
    """Every tensor reference of a JSON tree written by :func:`split_tree`."""
    if isinstance(data, dict):
        if _is_reference(data):
            yield data
            return
        for value in data.values():
            yield from tensor_references(value)
    elif isinstance(data, list):
        for value in data:
            yield from tensor_references(value)


def join_tree(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tree`. Every reference must name a tensor of ``tensors`` (checked by
    :func:`read_checkpoint` first; here a missing one is a ``KeyError``)."""
    if isinstance(data, dict):
        if _is_reference(data):
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


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


SAVE_HINT = ("free space or fix permissions there (earlier checkpoints and LoRA files are intact; resume with "
             "--resume auto)")


def save_hint(checkpoints: Path | None) -> str:
    """What a failed save leaves, read from ``checkpoints`` (the run's checkpoint folder): the newest complete
    checkpoint to resume from, or that there is none yet (a full disk at the first checkpoint)."""
    best = latest_complete(checkpoints)[0] if checkpoints is not None else None
    if best is None:
        return ("free space or fix permissions there (no checkpoint was saved before this one, so there is nothing "
                "to resume from: run again once there is room)")
    return (f"free space or fix permissions there (the checkpoint of step {best.step} and the files saved with it "
            "are intact; resume with --resume auto)")


def save_error(what: str, path: Path, exc: BaseException, *, checkpoints: Path | None = None) -> CheckpointWriteError:
    """The one line for a failed save of ``what`` (a checkpoint, a LoRA file) at ``path``: the reason, the free
    space there, and what was saved before (:func:`save_hint` of the run's ``checkpoints`` folder;
    ``core.atomic.storage_error``)."""
    found = storage_error(what, path, exc, hint=save_hint(checkpoints))
    return CheckpointWriteError(str(found), path=found.path, errno_value=found.errno)


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
            fsync_file(tmp / f)
        sums = {f: file_checksum(tmp / f) for f in sizes}  # read back from the page cache
        marker = {"step": step, "files": sizes, CHECKSUM: sums, "wantrain_version": __version__,
                  "time": time.time(), "format": FORMAT_VERSION}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        fsync_file(tmp / MARKER)
        fsync_dir(tmp)
        if final.exists():  # the same step again (a completed run resumed at its last step): swap, never tear
            old = directory / f".{name}.old-{os.getpid()}"
            with critical_section():  # a second Ctrl-C lands after both renames, never between them
                os.replace(final, old)
                os.replace(tmp, final)
            _remove_tree(old)
        else:
            os.replace(tmp, final)
        fsync_dir(directory)
    except Exception as exc:  # OSError; SafetensorError carries the OS error in its text
        _remove_tree(tmp)
        if isinstance(exc, OSError) or is_storage_error(exc):
            raise save_error("checkpoint", final, exc, checkpoints=directory) from exc
        raise
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


def file_checksum(path: Path) -> str:
    """The hex digest (:data:`CHECKSUM`) of the file ``path``, read in chunks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, CHECKSUM).hexdigest()


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Whether ``path`` is a complete checkpoint (marker present, files of the listed sizes). Cheap: checksums are
    :func:`verify_checkpoint`'s."""
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


def verify_checkpoint(path: Path) -> None:
    """Recompute the checksum of every file the marker of the complete checkpoint ``path`` lists; raise
    :class:`CheckpointDamaged` naming the first file that differs. A marker without checksums (written before
    wantrain kept them) is accepted on sizes alone."""
    marker = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    sums = marker.get(CHECKSUM)
    if sums is None:
        return
    if not isinstance(sums, dict) or set(sums) != set(marker["files"]):
        raise CheckpointDamaged(path, f"its completion marker lists no {CHECKSUM} for some of its files")
    for name, expected in sorted(sums.items()):
        if file_checksum(Path(path) / name) != expected:
            raise CheckpointDamaged(path, f"file '{name}' does not match its {CHECKSUM} checksum (its bytes changed "
                                          "after the save: disk or copy damage)")


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """Every ``step_*`` directory under ``directory`` (complete or torn), oldest step first. Temporary
    directories of interrupted saves (``.step_*.tmp-*``) are reported as torn too. A complete checkpoint that a
    kill left under its rotation name (``.step_N.old-PID``, between the two renames of a save that replaced step N)
    is reported as complete when no ``step_N`` exists: it is the only copy (:func:`remove_stale_temporaries`
    puts it back)."""
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
        elif _rotated_only_copy(p):
            found.append(inspect_checkpoint(p))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def _rotated_only_copy(path: Path) -> bool:
    """Whether ``path`` is ``.step_N.old-PID``, complete, with no ``step_N`` beside it."""
    m = _ROTATED.match(path.name)
    return bool(m) and not (path.parent / m.group(1)).exists() and inspect_checkpoint(path).complete


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
    """Load a complete checkpoint (tensors on the CPU), verified: checksums, then the files' structure (the state
    file's fields, every tensor reference against the tensors file's dtype and shape). Raises
    :class:`CheckpointDamaged` for damage and :class:`CheckpointReadError` for a torn or foreign one, both one line.
    What the tree holds is checked against the run by ``core.state_check``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    info = inspect_checkpoint(path)
    if not info.complete:
        raise CheckpointReadError(f"checkpoint '{path}' cannot be used: {info.problem}")
    try:
        verify_checkpoint(path)
        state = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(Path(path) / TENSOR_FILE), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise CheckpointReadError(f"checkpoint '{path}' is unreadable: {_one_line(exc)}") from None
    except ValueError as exc:  # JSON that does not parse
        raise CheckpointDamaged(path, f"a file does not parse ({_one_line(exc)})") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointDamaged(path, f"{STATE_FILE} is not a checkpoint state (no 'format')")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointReadError(
            f"checkpoint '{path}' has format {state.get('format')!r}; this wantrain reads format {FORMAT_VERSION}"
        )
    for key, kind in (("step", int), ("meta", dict), ("tree", dict)):
        if not isinstance(state.get(key), kind):
            raise CheckpointDamaged(path, f"{STATE_FILE} has no {key!r} {kind.__name__}")
    _check_references(path, state["tree"], tensors)
    return LoadedCheckpoint(Path(path), state["step"], join_tree(state["tree"], tensors), state["meta"])


def _check_references(path: Path, data: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Every reference names a tensor of the file, of the dtype and shape recorded with it; no tensor is left over."""
    referenced = set()
    for ref in tensor_references(data):
        name = ref["__tensor__"]
        referenced.add(name)
        if name not in tensors:
            raise CheckpointDamaged(path, f"tensor '{name}' named by {STATE_FILE} is missing from {TENSOR_FILE}")
        tensor = tensors[name]
        if "dtype" in ref and ref["dtype"] != dtype_name(tensor.dtype):
            raise CheckpointDamaged(path, f"tensor '{name}' is {dtype_name(tensor.dtype)} in {TENSOR_FILE}, "
                                          f"{STATE_FILE} records {ref['dtype']}")
        if "shape" in ref and list(ref["shape"]) != list(tensor.shape):
            raise CheckpointDamaged(path, f"tensor '{name}' has shape {list(tensor.shape)} in {TENSOR_FILE}, "
                                          f"{STATE_FILE} records {list(ref['shape'])}")
    extra = sorted(set(tensors) - referenced)
    if extra:
        raise CheckpointDamaged(path, f"{TENSOR_FILE} holds {len(extra)} tensors {STATE_FILE} does not name, "
                                      f"e.g. '{extra[0]}'")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def mark_announced(path: Path) -> None:
    """Record that the ``CheckpointSaved`` event of the checkpoint ``path`` reached every observer (the core calls
    it after the emit). Not listed in the marker: a checkpoint without it is complete, its event undelivered."""
    (Path(path) / ANNOUNCED).touch()


def was_announced(path: Path) -> bool:
    """Whether the ``CheckpointSaved`` event of ``path`` was delivered (a kill between the rename and the event's
    end leaves it undelivered: the resumed run delivers it again)."""
    return (Path(path) / ANNOUNCED).exists()


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
        if p.name.startswith(".step_") and (".deleting-" in p.name or ".old-" in p.name) and not _rotated_only_copy(p):
            _remove_tree(p)
    return removed


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporary directories left by interrupted saves (call once a run owns the directory); a complete
    checkpoint left only under its rotation name goes back to its ``step_*`` name instead. Returns what was
    removed."""
    removed = []
    if Path(directory).is_dir():
        for p in sorted(Path(directory).iterdir()):
            if _rotated_only_copy(p):
                os.replace(p, p.parent / _ROTATED.match(p.name).group(1))  # type: ignore[union-attr]
                continue
            if p.name.startswith(".step_") and any(s in p.name for s in (".tmp-", ".deleting-", ".old-")):
                _remove_tree(p)
                removed.append(p)
    return removed
