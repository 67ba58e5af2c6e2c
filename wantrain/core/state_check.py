"""What a checkpoint's state tree must hold before a resume may load it (called before anything is written).

``core.checkpoint`` guarantees that a tree is what was written (checksums, references, dtypes and shapes as
recorded). This module checks that it is what *this run* can continue from, so that ``Trainer.load_state_dict``
never meets a missing section (a ``KeyError`` deep in the loop) or a tensor it would copy silently into the wrong
place (an ``int32`` tensor copied into ``float32`` LoRA weights, a transposed moment broadcast or refused halfway):

* **the schema** of the core's tree (:meth:`wantrain.core.loop.Trainer.state_dict`): every section present and of
  the right kind (``train_state`` counters are ints, ``generator`` and the torch random state are ``uint8``
  tensors, ``optimizer`` has ``state`` and ``param_groups``, ...);
* **the model**: every tensor of the adapter's state (its ``state_dict()``, the LoRA weights) present, of the
  adapter's dtype and shape, and no other;
* **the optimizer**: as many parameter groups with as many parameters as the run's optimizer has, and each
  per-parameter state tensor with as many elements as its parameter of the parameter's shape, floating point (or
  ``uint8``: 8-bit optimizers' quantized moments).

The generator's state size is not checked: it depends on the device (a CPU generator's state is 5056 bytes, a CUDA
one's 16) and the loader handles a change of device. Observers' and the data's state are their owners'.

:func:`check_state_tree` returns a problem (one line, naming the tensor or section) or None; the caller raises
``CheckpointDamaged`` with it. Everything here reads host values only (a checkpoint's tensors are on the CPU;
the expected tensors' ``dtype``/``shape`` are metadata): no device sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from wantrain.core.checkpoint import dtype_name

SECTIONS: dict[str, tuple[type, ...]] = {
    "train_state": (dict,), "generator": (torch.Tensor,), "rng": (dict,), "model": (dict,), "optimizer": (dict,),
    "scheduler": (dict, type(None)), "data": (dict, type(None)), "metrics": (dict,), "observers": (dict,),
}
"""The core's sections and their kinds (``interval``, or ``nonfinite_guard`` in older checkpoints, is checked
apart)."""

_KIND = {dict: "a table", torch.Tensor: "a tensor", type(None): "null", list: "a list", int: "an integer"}


def check_state_tree(tree: Any, *, model: Mapping[str, Any] | None = None,
                     param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> str | None:
    """The first way ``tree`` does not fit the run, or None. ``model``: the adapter's state (tensors stand for
    their dtype and shape; nested dicts allowed); ``param_groups``: the parameters of each optimizer group, in
    the order the optimizer is built with."""
    if not isinstance(tree, Mapping):
        return "the state tree is not a table"
    problem = _schema(tree)
    if problem is None and model is not None:
        problem = _same_tensors(tree["model"], model, "model")
    if problem is None and param_groups is not None:
        problem = _optimizer(tree["optimizer"], param_groups)
    return problem


def _schema(tree: Mapping[str, Any]) -> str | None:
    for name, kinds in SECTIONS.items():
        if name not in tree:
            return f"section '{name}' is missing from the state tree"
        if not isinstance(tree[name], kinds):
            return f"section '{name}' is {_kind(tree[name])}, expected {' or '.join(_KIND[k] for k in kinds)}"
    if "interval" not in tree and "nonfinite_guard" not in tree:
        return "section 'interval' is missing from the state tree"
    for key in ("step", "micro_step"):
        value = tree["train_state"].get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"'train_state/{key}' is {value!r}, expected a count (an integer >= 0)"
    problem = _byte_tensor(tree["generator"], "generator")
    if problem:
        return problem
    rng = tree["rng"]
    for key, kinds in (("python", (dict,)), ("numpy", (dict,)), ("torch", (torch.Tensor,))):
        if not isinstance(rng.get(key), kinds):
            return f"'rng/{key}' is {_kind(rng.get(key))}, expected {_KIND[kinds[0]]}"
    problem = _byte_tensor(rng["torch"], "rng/torch")
    if problem:
        return problem
    optimizer = tree["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list):
        return "section 'optimizer' lacks its 'state' table or its 'param_groups' list"
    for i, group in enumerate(optimizer["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            return f"'optimizer/param_groups/{i}' has no 'params' list"
    if not isinstance(tree["metrics"].get("sums", {}), dict):
        return "'metrics/sums' is not a table"
    return None


def _byte_tensor(value: torch.Tensor, where: str) -> str | None:
    if value.dtype != torch.uint8 or value.dim() != 1:
        return f"'{where}' is a {dtype_name(value.dtype)} tensor of shape {list(value.shape)}, expected 1-D uint8"
    return None


def _same_tensors(saved: Any, expected: Any, where: str) -> str | None:
    """``saved`` has the structure of ``expected`` (dict keys, tensors of the same dtype and shape)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"'{where}' is {_kind(saved)}, expected a tensor"
        if saved.dtype != expected.dtype:
            return f"tensor '{where}' is {dtype_name(saved.dtype)}, this run's is {dtype_name(expected.dtype)}"
        if saved.shape != expected.shape:
            return f"tensor '{where}' has shape {list(saved.shape)}, this run's has {list(expected.shape)}"
        return None
    if isinstance(expected, Mapping):
        if not isinstance(saved, Mapping):
            return f"'{where}' is {_kind(saved)}, expected a table"
        missing = [k for k in expected if k not in saved]
        extra = [k for k in saved if k not in expected]
        if missing:
            return f"'{where}/{missing[0]}' is missing ({len(missing)} entries this run has are not in the checkpoint)"
        if extra:
            return f"'{where}/{extra[0]}' is not part of this run ({len(extra)} entries the run does not have)"
        for key, value in expected.items():
            problem = _same_tensors(saved[key], value, f"{where}/{key}")
            if problem:
                return problem
    return None  # scalars (alpha values, ...) are their owners' to check


def _optimizer(saved: Mapping[str, Any], groups: Sequence[Sequence[torch.Tensor]]) -> str | None:
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        return f"'optimizer' has {len(saved_groups)} parameter groups, this run's optimizer has {len(groups)}"
    params: dict[Any, torch.Tensor] = {}
    for i, (group, mine) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(group["params"]) != len(mine):
            return (f"'optimizer/param_groups/{i}' ({group.get('name', i)}) has {len(group['params'])} parameters, "
                    f"this run's has {len(mine)}")
        params.update(zip(group["params"], mine, strict=True))
    for index, entry in saved["state"].items():
        if index not in params:
            return f"'optimizer/state/{index}' belongs to no parameter of the saved groups"
        if not isinstance(entry, Mapping):
            return f"'optimizer/state/{index}' is {_kind(entry)}, expected a table"
        param = params[index]
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() != param.numel():
                continue  # step counts, per-row factors, quantization tables: the optimizer's own
            where = f"optimizer/state/{index}/{key}"
            if value.shape != param.shape:
                return f"tensor '{where}' has shape {list(value.shape)}, its parameter has {list(param.shape)}"
            if param.is_floating_point() and not (value.is_floating_point() or value.dtype == torch.uint8):
                return f"tensor '{where}' is {dtype_name(value.dtype)}, expected floating point like its parameter"
    return None


def _kind(value: Any) -> str:
    for kind, name in _KIND.items():
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return name
    return f"a {type(value).__name__}"
