"""Global L2 norms of the LoRA parameters and of their gradients, computed on the device once per log step.

Metrics (all put as 0-dim device tensors into ``ctx.metrics``; the core converts them in its one transfer):

* ``train/grad_norm`` -- sqrt(sum ||g||^2) over the gradients of every trainable parameter that has one, read at
  ``GradsReady``: accumulated over the micro-steps, BEFORE clipping (what clipping compares with its threshold).
* ``train/grad_norm/<expert>`` -- the same over one expert's parameters (only the active expert has gradients).
* ``train/total_param_norm`` -- sqrt(sum ||p||^2) over all trainable parameters (every expert), read at
  ``OptimizerStepped``, i.e. after the update. A true global L2 norm, not the seed's sum of per-tensor norms.
* ``train/param_norm/<expert>`` -- the same over one expert's parameters.

Nothing here syncs the device: ``torch._foreach_norm`` gives per-tensor norms in one fused launch per device, one
``linalg.vector_norm`` of their stack reduces them. Parameters of an inactive expert may live on the CPU (the core
moves it off the device); its partial sum is a 0-dim CPU tensor, which a device op takes as a host scalar (no
transfer). An inactive expert does not change, so its partial sum is cached until it becomes active again.

Cost: the list of trainable parameters of each expert is built once per run (at its first log step) instead of
walking the modules on every log step; this relies on the adapter keeping Parameter identity when it moves an
expert between devices (``Wan22Adapter.activate`` does for cpu/cuda; ``Module.to`` keeps it). Non-log steps
return at the first line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import ExpertSwitched, GradsReady, OptimizerStepped, RunStarted


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """sum ||t||^2 over ``tensors`` as a float32 0-dim tensor (None when empty). Device ops only, no sync.

    Tensors are grouped by device; each group costs one ``_foreach_norm`` and one reduction. Partial sums from
    other devices are added as 0-dim CPU scalars (host values, no transfer) or moved non-blocking.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach())
    if not by_device:
        return None
    partials = []
    for group in by_device.values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        partials.append(torch.linalg.vector_norm(torch.stack(norms), 2).square())
    return _combine(partials)


def _combine(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum 0-dim tensors that may sit on different devices, on the first non-CPU one (no sync)."""
    primary = next((p for p in partials if p.device.type != "cpu"), partials[0])
    total = primary
    for p in partials:
        if p is primary:
            continue
        if p.device == primary.device or p.device.type == "cpu":
            total = total + p  # a 0-dim CPU tensor enters a device op as a host scalar: no copy, no sync
        else:
            total = total + p.to(primary.device, non_blocking=True)
    return total


class Norms(Observer):
    """Puts grad and parameter norms into ``ctx.metrics`` on log steps only; device ops, never a host sync."""

    priority = Priority.SINK

    def __init__(self) -> None:
        # sum ||p||^2 of experts that are not being trained (their parameters cannot change until reactivated)
        self._inactive_sq: dict[str, torch.Tensor] = {}
        # expert (None: all) -> its trainable parameters; dropped whenever the adapter may have replaced them
        self._params: dict[str | None, list[torch.Tensor]] = {}

    def _parameters(self, adapter, expert: str | None) -> list[torch.Tensor]:
        params = self._params.get(expert)
        if params is None:
            params = self._params[expert] = list(adapter.trainable_parameters(expert))
        return params

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self._inactive_sq.clear()
        self._params.clear()

    @on(ExpertSwitched)
    def on_expert_switched(self, event: ExpertSwitched, ctx) -> None:
        # the previous expert was trained until now; the new one is about to change: both caches are stale
        for expert in (event.previous, event.expert):
            if expert is not None:
                self._inactive_sq.pop(expert, None)

    @on(GradsReady)
    def on_grads_ready(self, event: GradsReady, ctx) -> None:
        if not event.is_log_step or ctx.adapter is None:
            return
        experts = _named_experts(ctx.adapter)
        partials = []
        for expert in experts:
            sq = sum_of_squares(p.grad for p in self._parameters(ctx.adapter, expert) if p.grad is not None)
            if sq is not None:
                ctx.metrics.put(f"train/grad_norm/{expert}", sq.sqrt())
                partials.append(sq)
        if not experts:
            sq = sum_of_squares(p.grad for p in self._parameters(ctx.adapter, None) if p.grad is not None)
            if sq is not None:
                partials.append(sq)
        if partials:
            ctx.metrics.put("train/grad_norm", _combine(partials).sqrt())

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx) -> None:
        if not event.is_log_step or ctx.adapter is None:
            return
        experts = _named_experts(ctx.adapter)
        partials = []
        for expert in experts:
            sq = self._inactive_sq.get(expert) if expert != event.expert else None
            if sq is None:
                sq = sum_of_squares(self._parameters(ctx.adapter, expert))
                if sq is None:
                    continue
                if expert != event.expert:
                    self._inactive_sq[expert] = sq
            ctx.metrics.put(f"train/param_norm/{expert}", sq.sqrt())
            partials.append(sq)
        if not experts:
            sq = sum_of_squares(self._parameters(ctx.adapter, None))
            if sq is not None:
                partials.append(sq)
        if partials:
            ctx.metrics.put("train/total_param_norm", _combine(partials).sqrt())

    def close(self) -> None:
        self._inactive_sq.clear()
        self._params.clear()


def _named_experts(adapter) -> tuple[str, ...]:
    return tuple(e for e in getattr(adapter, "experts", (None,)) if e is not None)
