"""What every handler receives besides its event: the run's live objects, the control object, and the metrics
collector that turns device values into host values once per log interval."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.control import Control
from wantrain.core.state import TrainState


@attrs.define
class Live:
    """Device objects of the current dispatch. Cleared by the core after each micro-step (``loss``, ``batch``) and
    after each optimizer step (``grad_norm``) so that nothing keeps device tensors alive between steps.

    ``grad_norm``: the global L2 norm of the gradients before clipping (0-dim, on the device), computed by the core
    for clipping and the non-finite guard; set from ``GradsReady`` until the optimizer step has run.
    """

    loss: torch.Tensor | None = None
    batch: Mapping[str, Any] | None = None
    grad_norm: torch.Tensor | None = None

    def clear(self) -> None:
        self.loss = None
        self.batch = None
        self.grad_norm = None


class DeviceMetrics:
    """Collects metric values during a log interval and converts them to host floats in ONE transfer.

    Observers call :meth:`put` (or :meth:`accumulate`) with device tensors at any point; nothing syncs there.
    At a log step the core calls :meth:`gather`, which stacks every pending tensor and calls ``.tolist()`` once:
    this is the only device->host sync point of the interval (nanoGPT's ``loss.item()`` every ``log_interval``).
    Python floats are passed through as they are (psutil and ``torch.cuda.memory_allocated`` are host values).
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._sums: dict[str, tuple[torch.Tensor, torch.Tensor | int]] = {}
        self._floats: dict[str, float] = {}

    def put(self, name: str, value: torch.Tensor | float) -> None:
        """Set ``name`` for this interval (the last value put wins)."""
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                value = value.detach()
            self._tensors[name] = value if value.dim() == 0 else value.reshape(())  # no op for a 0-dim value
        else:
            self._floats[name] = float(value)

    def accumulate(self, name: str, value: torch.Tensor, *, finite_only: bool = False) -> None:
        """Add ``value`` to the running mean of ``name`` over the interval (device-side). ``finite_only``: a
        non-finite value is left out of the mean (also decided on the device); an interval with none has no value."""
        v = value.detach().reshape(()).float()
        n: torch.Tensor | int = 1
        if finite_only:
            ok = torch.isfinite(v)
            v, n = torch.where(ok, v, 0.0), ok.float()
        if name in self._sums:
            total, count = self._sums[name]
            self._sums[name] = (total + v, count + n)
        else:
            self._sums[name] = (v, n)

    def pending(self) -> tuple[str, ...]:
        return (*self._tensors, *self._sums, *self._floats)

    def gather(self) -> dict[str, float]:
        """All values of the interval as host floats, then reset. One device->host transfer."""
        return self.gather_with(())[0]

    def gather_with(self, extra: Sequence[torch.Tensor]) -> tuple[dict[str, float], list[float]]:
        """:meth:`gather`, with the 1-D tensors ``extra`` (the core's own interval values) in the same transfer;
        returns their host values concatenated, in order."""
        names: list[str] = []
        parts: list[torch.Tensor] = []
        parts.extend(self._tensors.values())
        names.extend(self._tensors)
        counted: list[str] = []  # finite-only sums: their counts travel too, so empty ones can be left out
        for name, (total, count) in self._sums.items():
            names.append(name)
            parts.append(total / count)
        for name, (_, count) in self._sums.items():
            if isinstance(count, torch.Tensor):
                counted.append(name)
                parts.append(count)
        out: dict[str, float] = {}
        extra_host: list[float] = []
        if parts or extra:
            device = parts[0].device if parts else extra[0].device
            vectors = [torch.stack([p if p.device == device else p.to(device) for p in parts])] if parts else []
            vectors.extend(e if e.device == device else e.to(device) for e in extra)
            # this is the CPU-GPU sync point of the log interval (cat promotes every dtype to a common float type)
            host = (torch.cat(vectors) if len(vectors) > 1 else vectors[0]).tolist()
            for name, value in zip(names, host, strict=False):
                out[name] = float(value)
            for name, count in zip(counted, host[len(names):], strict=False):
                if count == 0:
                    del out[name]  # no finite value in the interval: not measured, not NaN
            extra_host = host[len(names) + len(counted):]
        out.update(self._floats)
        self._tensors.clear()
        self._sums.clear()
        self._floats.clear()
        return out, extra_host

    def state_dict(self) -> dict[str, object]:
        """The interval's pending sums (for a checkpoint taken between log steps; values put for this step only
        are not kept)."""
        return {"sums": {name: {"total": total, "count": count} for name, (total, count) in self._sums.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._sums = {name: (s["total"], s["count"]) for name, s in state.get("sums", {}).items()}


@attrs.define(eq=False)
class Context:
    """Handed to every handler with its event. Observers read from it and request through ``control``.

    ``adapter`` is the model, typed by the capabilities an observer declares in ``needs`` (``core.adapter``);
    ``adapter``, ``optimizer`` and ``scheduler`` are live objects to read: device operations on them are allowed
    (changes to the model or the optimizer go through ``control``), host syncs are not (except in handlers of
    ``MetricsLogged``, ``RunStarted``, ``CheckpointSaved`` and ``RunEnded``).
    ``generator`` is the trainer's generator (timesteps and noise are drawn from it): read its state with
    ``get_state()`` (a host copy, no sync); never draw from it or set it -- ask ``control.set_generator_state``.
    """

    control: Control
    state: TrainState
    metrics: DeviceMetrics
    live: Live
    run_dir: Path | None = None
    adapter: Any = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    generator: torch.Generator | None = None
