"""The run's counters and its state tree: everything a checkpoint needs to continue bitwise.

:class:`TrainState` holds the counters the core updates. :func:`capture` builds the tree that ``core.checkpoint``
writes -- the counters, the trainer's generator and every global random stream (Python, numpy, torch, CUDA), the
model's trainable weights, the optimizer, the scheduler, the data position, the pending interval sums and each
stateful observer's state -- and :func:`restore` puts one back before a run resumes. The trainer calls both
(``Trainer.state_dict`` / ``Trainer.load_state_dict``) with the parts it was built from (:class:`RunParts`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from wantrain.core.parallel.sharding import is_sharded, like, whole, whole_to_writer


@attrs.define
class TrainState:
    """Counters of the run. Plain ints, updated by the core only."""

    step: int = 0  # optimizer steps taken (including skipped ones)
    micro_step: int = 0
    total_steps: int = 0
    expert: str | None = None
    consecutive_oom: int = 0
    skipped_steps: int = 0


@attrs.define(eq=False)
class RunParts:
    """The live objects whose state the tree holds (the trainer's; ``bus`` gives the attached observers)."""

    state: TrainState
    generator: torch.Generator
    adapter: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: Any
    metrics: Any  # core.context.DeviceMetrics
    interval: Any  # core.interval.LogInterval
    bus: Any


def capture(parts: RunParts, *, to_writer: bool = False) -> dict[str, Any]:
    """The run's state as a tree of tensors and JSON values (live references: ``core.checkpoint`` copies). Sharded
    tensors (model.parallel = "fsdp") come whole on every rank; with ``to_writer`` (a save) whole on the CPU of the
    writing rank only and as empty ``meta`` tensors elsewhere (``core.parallel.sharding.whole_to_writer``): those
    ranks send only their own :data:`~wantrain.core.parallel.distributed.PER_RANK_STATE`."""
    adapter = parts.adapter
    if callable(getattr(adapter, "state_dict", None)):
        model = adapter.state_dict()
    else:
        model = {f"{e}/{i}": p for e in adapter.experts for i, p in enumerate(adapter.trainable_parameters(e))}
    batches, scheduler = parts.batches, parts.scheduler
    return {
        "train_state": attrs.asdict(parts.state),
        "generator": parts.generator.get_state(),
        "rng": capture_rng(parts.generator.device),
        "model": _whole_tree(model, to_writer),
        "optimizer": _whole_tree(parts.optimizer.state_dict(), to_writer),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data": batches.state_dict() if callable(getattr(batches, "state_dict", None)) else None,
        "metrics": parts.metrics.state_dict(),
        "interval": parts.interval.state_dict(),
        "observers": {name: obs.state_dict() for name, obs in stateful_observers(parts.bus.observers)},
    }


def restore(parts: RunParts, tree: Mapping[str, Any]) -> list[str]:
    """Put :func:`capture` output back before a run. The optimizer's hyperparameters (LR, betas, ...) stay those
    of the current config, except group keys the optimizer names in ``group_state_keys``; everything else is the
    saved state. Returns warnings (the trainer's random stream reseeded after a change of device type; observers
    whose state was saved but that are not attached now, or attached but without saved state)."""
    for f in attrs.fields(TrainState):
        if f.name != "total_steps" and f.name in tree["train_state"]:
            setattr(parts.state, f.name, tree["train_state"][f.name])
    notes = _restore_generator(parts.generator, tree["generator"].to(torch.uint8))
    _restore_model(parts.adapter, tree["model"])
    _restore_optimizer(parts.optimizer, tree["optimizer"])
    scheduler, batches = parts.scheduler, parts.batches
    if scheduler is not None and tree.get("scheduler") is not None:
        scheduler.load_state_dict(tree["scheduler"])
        if callable(getattr(scheduler, "get_last_lr", None)):
            # torch's schedulers restore their counters but not the groups' LR: put back the saved step's LR
            for group, lr in zip(parts.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
    if tree.get("data") is not None and callable(getattr(batches, "load_state_dict", None)):
        batches.load_state_dict(tree["data"])
    metric_state = {"sums": dict(tree["metrics"].get("sums", {}))}
    if "interval" in tree:
        parts.interval.load_state_dict(tree["interval"])
    else:  # written before core.interval existed: device-side guard counters, loss sums in the metrics
        parts.interval.load_legacy(tree["nonfinite_guard"], metric_state["sums"])
    parts.metrics.load_state_dict(metric_state)
    warnings = notes
    saved = dict(tree.get("observers", {}))
    for name, obs in stateful_observers(parts.bus.observers):
        if name in saved:
            obs.load_state_dict(saved.pop(name))
        else:
            warnings.append(f"observer {name} has no state in the checkpoint; it starts fresh")
    warnings += [f"the checkpoint holds state of observer {name}, which is not attached; ignored" for name in saved]
    restore_rng(tree["rng"], parts.generator.device)
    return warnings


def _restore_model(adapter: Any, model: Mapping[str, Any]) -> None:
    if callable(getattr(adapter, "load_state_dict", None)):
        adapter.load_state_dict(model)
        return
    with torch.no_grad():
        for e in adapter.experts:
            for i, p in enumerate(adapter.trainable_parameters(e)):
                p.copy_(model[f"{e}/{i}"])


def _whole_tree(tree: Any, to_writer: bool = False) -> Any:
    """``tree`` with every ``DTensor`` (model.parallel = "fsdp") replaced by its whole tensor: a checkpoint holds
    whole tensors in every layout, so one written by N ranks resumes at another world size or without sharding.
    Every rank calls it, in the same order: an all-gather per tensor, or with ``to_writer`` a gather to the writing
    rank (the others get ``meta`` tensors). No sharded tensor: ``tree`` itself."""
    if isinstance(tree, Mapping):
        return {k: _whole_tree(v, to_writer) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_whole_tree(v, to_writer) for v in tree]
    if not is_sharded(tree):
        return tree
    return whole_to_writer(tree) if to_writer else whole(tree)


def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    # Group keys an optimizer names in ``group_state_keys`` are its state (Prodigy's d, schedule-free's k), not
    # hyperparameters: they keep their saved values.
    evolving = {"params", *getattr(optimizer, "group_state_keys", ())}
    fresh = [{k: v for k, v in g.items() if k not in evolving} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for param, entries in optimizer.state.items():  # fsdp: each rank keeps its shard of the whole tensors saved
        if is_sharded(param):
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    entries[key] = like(value, param)
    for group, hyper in zip(optimizer.param_groups, fresh, strict=True):
        group.update(hyper)  # the config's hyperparameters win (a changed LR is allowed on resume)


def stateful_observers(observers: Iterable[Any]) -> list[tuple[str, Any]]:
    """(unique name, observer) of every observer with ``state_dict``/``load_state_dict``, in attachment order;
    a second observer of the same name is keyed ``name#2``."""
    out, seen = [], {}
    for obs in observers:
        if callable(getattr(obs, "state_dict", None)) and callable(getattr(obs, "load_state_dict", None)):
            name = getattr(obs, "name", type(obs).__name__)
            seen[name] = seen.get(name, 0) + 1
            out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", obs))
    return out


def _restore_generator(generator: torch.Generator, saved: torch.Tensor) -> list[str]:
    """Put the trainer's generator back. A generator's state is typed by its device (CUDA's Philox state is 16
    bytes, the CPU's Mersenne Twister 5056): a checkpoint written with ``train.device`` of another type cannot be
    put into this one, so the stream is reseeded from the saved state, deterministically, with a note."""
    mine = generator.get_state()
    if saved.numel() == mine.numel():
        generator.set_state(saved)
        return []
    import hashlib

    generator.manual_seed(int.from_bytes(hashlib.sha256(saved.numpy().tobytes()).digest()[:8], "little") % 2**63)
    return [f"the trainer's random stream was saved on another device type ({saved.numel()} bytes of state; this "
            f"run's generator on {generator.device.type} has {mine.numel()}): reseeded from the saved state, so "
            "timesteps and noise from here on differ from an uninterrupted run's"]


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Python's, numpy's and torch's global random states, and CUDA's of the training ``device`` only (when it is
    in use): the others' would not exist on a machine with fewer GPUs."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(rng: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Put :func:`capture_rng` output back; the CUDA state goes to the training ``device`` (a checkpoint written
    before issue 23 holds one per visible GPU: the training device's index is taken, if it exists)."""
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = rng["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(rng["torch"].to(torch.uint8))
    if "cuda" in rng and device is not None and device.type == "cuda" and torch.cuda.is_available():
        state = rng["cuda"]
        if isinstance(state, list | tuple):
            index = device.index if device.index is not None else torch.cuda.current_device()
            state = state[index] if index < len(state) else None
        if state is not None:
            torch.cuda.set_rng_state(state.to(torch.uint8), device)
