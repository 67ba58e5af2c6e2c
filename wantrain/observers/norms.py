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
transfer). An inactive expert does not change, so its partial sum is cached until it becomes active again; the sum
an expert had at the log step that ended its block is that cache (one sum per log step instead of two when
``switch_every`` is a multiple of ``log_every``).

Cost: ``train/grad_norm`` (and the active expert's) is the core's own pre-clip norm (``ctx.live.grad_norm``,
computed for clipping and the non-finite guard), put as it is: no device work, unless an inactive expert has
gradients too (a custom loop), where the norms are computed here as above. The list of trainable parameters of each
expert is built once per run (at its first log step) instead of walking the modules on every log step; this relies
on the adapter keeping Parameter identity when it moves an expert between devices (``Wan22Adapter.activate`` does
for cpu/cuda; ``Module.to`` keeps it). Non-log steps return at the first line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import ExpertSwitched, GradsReady, OptimizerStepped, RunStarted
from wantrain.core.parallel.sharding import is_sharded, summed_over_shards


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """sum ||t||^2 over ``tensors`` as a float32 0-dim tensor (None when empty). Device ops only, no sync.

    Tensors are grouped by device. On an accelerator each group costs one ``_foreach_norm`` (one fused kernel) and
    one reduction. On the CPU ``_foreach_norm`` has no fused kernel and dispatches one norm per tensor (about 1.5 us
    each); there a LoRA's matrices are concatenated into two tensors (:func:`group_tensors`) and reduced with about
    seven ops, 3x cheaper for the tiny model's 40 tensors. Partial sums from other devices are added as 0-dim CPU
    scalars (host values, no transfer) or moved non-blocking.
    """
    tensors = list(tensors)
    return _over_shards(sum_of_squares_grouped(group_tensors(local_parts(tensors))), tensors)


def local_parts(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor, or this rank's shard of a ``DTensor`` (model.parallel = "fsdp"): the norms are taken of the
    shards and their squares summed over the ranks (:func:`_over_shards`), never of gathered whole tensors."""
    return [t.to_local() if is_sharded(t) else t for t in tensors]


def _over_shards(sq: torch.Tensor | None, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``sq`` (a sum of squares over this rank's shards) summed over the ranks that shard ``tensors`` (a
    device-side all-reduce), or ``sq`` itself when nothing is sharded."""
    first = next((t for t in tensors if is_sharded(t)), None)
    return sq if sq is None or first is None else summed_over_shards(sq, first)


def group_tensors(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[tuple[int | None, list[torch.Tensor]]]]:
    """The grouping :func:`sum_of_squares_grouped` reduces, per device: ``(dim, tensors)`` pairs. On an accelerator
    one pair (``_foreach_norm`` takes them all). On the CPU, 2-D tensors that share their smaller dimension (a LoRA's
    ``A`` matrices share their rank rows, its ``B`` matrices their rank columns) are concatenated along the other one
    (``dim``), anything else is stacked by shape (``dim`` None): a LoRA reduces in two concatenations. Build it once
    for tensors that keep their device and shape (parameters)."""
    by_device: dict[torch.device, dict[Any, list[torch.Tensor]]] = {}
    for t in tensors:
        device = t.device
        if device.type != "cpu":
            key: Any = None
        elif t.dim() == 2:
            key = (1, t.shape[0]) if t.shape[0] <= t.shape[1] else (0, t.shape[1])
        else:
            key = (None, t.shape)
        by_device.setdefault(device, {}).setdefault(key, []).append(t)
    return {device: [(key[0] if key is not None else None, group) for key, group in groups.items()]
            for device, groups in by_device.items()}


def sum_of_squares_grouped(grouped: dict[torch.device, list[tuple[int | None, list[torch.Tensor]]]]
                           ) -> torch.Tensor | None:
    if not grouped:
        return None
    partials = []
    with torch.no_grad():  # instead of detaching every tensor (one op each)
        for device, groups in grouped.items():
            if device.type == "cpu":
                norms = [torch.linalg.vector_norm(
                    group[0] if len(group) == 1 else torch.stack(group) if dim is None else torch.cat(group, dim),
                    2, dtype=torch.float32) for dim, group in groups]
            else:
                norms = torch._foreach_norm(groups[0][1], 2, dtype=torch.float32)
            partials.append(torch.linalg.vector_norm(torch.stack(norms), 2).square() if len(norms) > 1
                            else norms[0].square())
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
        # (sum ||p||^2, its sqrt) of experts that are not being trained (they cannot change until reactivated)
        self._inactive_sq: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # expert (None: all) -> its trainable parameters; dropped whenever the adapter may have replaced them
        self._params: dict[str | None, list[torch.Tensor]] = {}
        # active expert -> (step, (sum ||p||^2, its sqrt)) taken after that step's update
        self._active_sq: dict[str, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        # expert -> (device of its first parameter, the parameters grouped for sum_of_squares_grouped)
        self._grouped: dict[str | None, tuple[torch.device, dict]] = {}

    def _parameters(self, adapter, expert: str | None) -> list[torch.Tensor]:
        params = self._params.get(expert)
        if params is None:
            params = self._params[expert] = list(adapter.trainable_parameters(expert))
        return params

    def _param_sum_of_squares(self, adapter, expert: str | None) -> torch.Tensor | None:
        params = self._parameters(adapter, expert)
        if not params:
            return None
        device = params[0].device  # an expert moves as a whole (activate): regroup when it moved
        cached = self._grouped.get(expert)
        if cached is None or cached[0] != device:
            cached = self._grouped[expert] = (device, group_tensors(local_parts(params)))
        return _over_shards(sum_of_squares_grouped(cached[1]), params)

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self.close()

    @on(ExpertSwitched)
    def on_expert_switched(self, event: ExpertSwitched, ctx) -> None:
        # the new expert is about to change: its cache is stale. The previous one was trained until now: its sums
        # are still valid when they were taken after its last update (a log step ending its block, as with the
        # default switch_every = log_every = 10), else they are computed again at the next log step.
        if event.expert is not None:
            self._inactive_sq.pop(event.expert, None)
        last = self._active_sq.pop(event.previous, None) if event.previous is not None else None
        if last is not None and last[0] == event.step - 1:
            self._inactive_sq[event.previous] = last[1]
        elif event.previous is not None:
            self._inactive_sq.pop(event.previous, None)

    @on(GradsReady)
    def on_grads_ready(self, event: GradsReady, ctx) -> None:
        if not event.is_log_step or ctx.adapter is None:
            return
        experts = _named_experts(ctx.adapter)
        shared = getattr(ctx.live, "grad_norm", None)
        if shared is not None and self._only_active_has_grads(ctx.adapter, experts, event.expert):
            # the core's own norm (computed for clipping and the guard) is this very value: no device work here
            ctx.metrics.put("train/grad_norm", shared)
            if event.expert is not None:
                ctx.metrics.put(f"train/grad_norm/{event.expert}", shared)
            return
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
            cached = self._inactive_sq.get(expert) if expert != event.expert else None
            if cached is None:
                sq = self._param_sum_of_squares(ctx.adapter, expert)
                if sq is None:
                    continue
                cached = (sq, sq.sqrt())
                if expert != event.expert:
                    self._inactive_sq[expert] = cached
                else:
                    self._active_sq[expert] = (event.step, cached)
            ctx.metrics.put(f"train/param_norm/{expert}", cached[1])
            partials.append(cached[0])
            only_norm = cached[1]
        if not experts:
            sq = self._param_sum_of_squares(ctx.adapter, None)
            if sq is not None:
                partials.append(sq)
        if len(partials) == 1 and experts:
            ctx.metrics.put("train/total_param_norm", only_norm)  # one expert with parameters: its norm is the total
        elif partials:
            ctx.metrics.put("train/total_param_norm", _combine(partials).sqrt())

    def _only_active_has_grads(self, adapter, experts: tuple[str, ...], active: str | None) -> bool:
        """True when every gradient belongs to the active expert (always, with the core's expert switching), so
        that the core's global norm is also the active expert's; a host-side check of ``.grad is None``."""
        if not experts:
            return True
        if active not in experts:
            return False
        return all(p.grad is None for e in experts if e != active for p in self._parameters(adapter, e))

    def close(self) -> None:
        self._inactive_sq.clear()
        self._active_sq.clear()
        self._params.clear()
        self._grouped.clear()


def _named_experts(adapter) -> tuple[str, ...]:
    return tuple(e for e in getattr(adapter, "experts", (None,)) if e is not None)
