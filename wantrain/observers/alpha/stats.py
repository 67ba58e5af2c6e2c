"""The alpha controller's statistics, computed on the device (no host sync; docs/alpha_schedule.md has the formulas).

One :class:`DeviceWindow` per expert holds that expert's last ``size`` per-step losses, another its last ``size``
gradient-stability values; experts never share a window. At a log step :func:`loss_statistics` and
:func:`window_mean` turn a window into 0-dim device tensors, which the controller puts into ``ctx.metrics``: the
core's one device->host transfer of the interval carries them to the host (and into ``MetricsLogged.values``,
where the decisions read them).

Over the finite values ``y_i`` of a window at chronological positions ``x_i`` (oldest first; non-finite values,
i.e. steps the non-finite guard skipped, are left out), with ``n`` values, means ``x̄``, ``ȳ``:

* ``loss_slope``  b = Sxy / Sxx (loss units per step), Sxy = Σ(x-x̄)(y-ȳ), Sxx = Σ(x-x̄)², Syy = Σ(y-ȳ)²
* ``loss_r2``     R² = Sxy² / (Sxx·Syy)  (0 when the losses are all equal)
* ``loss_cv``     CV = sqrt(Syy / n) / |ȳ|  (population standard deviation over the mean)
* ``loss_improvement_rate``  I = -100·b / ȳ: the fitted loss's relative decrease per 100 steps (0.05: the loss
  falls by 5 % of its mean every 100 steps; negative: it rises). Unit-free, so one threshold fits any loss scale.
* ``loss_improvement_rate_se``  the standard error of I by batch means, valid when the per-step losses are
  autocorrelated: the window's newest ``B·m`` values cut into ``B = min(BLOCKS, size)`` consecutive blocks of
  ``m = size // B`` steps; the block means ``ȳ_b`` at their mean positions ``x_b`` are fitted by least squares and
  se(I) = 100·sqrt(SSE_b / ((B'-2)·Sxx_b)) / |ȳ|, SSE_b = Syy_b - Sxy_b²/Sxx_b, ``B'`` the blocks with a finite
  value (NaN for B' < 3).
* ``loss_improvement_rate_dof``  B' - 2, the degrees of freedom of that standard error (the policy's t quantiles).
* ``loss_samples``  n

Gradient stability of one optimizer step of an expert (:class:`SignAgreement`): over every element ``j`` of all its
LoRA gradient tensors, with ``g`` this step's gradient and ``g'`` the expert's previous step's,
``s = #{j: g_j·g'_j > 0} / #{j: g_j·g'_j ≠ 0}`` -- the fraction of elements whose gradient kept its sign, among
those where neither gradient is zero (NaN when there is none). Random signs give 0.5. Optimizer-agnostic: it reads
``p.grad`` at ``GradsReady`` (accumulated over the micro-steps, before clipping). ``gradient_stability`` is the mean
of the finite ``s`` in the expert's window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCKS = 20
"""Blocks of the batch-means standard error: with the presets' windows each block is 100+ steps, far longer than
the correlation time of per-step losses (a few steps), and 18 degrees of freedom cost little power."""

def _stat_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class DeviceWindow:
    """The last ``size`` values pushed, in a ring buffer on ``device``. ``count`` (host int) counts every push;
    slots not yet written hold NaN. :meth:`push` is one device copy, no sync. ``batch`` (a shape) keeps that many
    independent windows side by side, pushed together (the property tests run hundreds of synthetic streams at
    once); the controller uses one."""

    def __init__(self, size: int, device: torch.device | str, batch: tuple[int, ...] = ()) -> None:
        self.size = int(size)
        self.device = torch.device(device)
        self.batch = tuple(batch)
        self.values = torch.full((*self.batch, self.size), float("nan"), device=self.device,
                                 dtype=_stat_dtype(self.device))
        self.count = 0

    def push(self, value: torch.Tensor) -> None:
        self.values[..., self.count % self.size] = value.detach().reshape(self.batch).to(self.values.dtype)
        self.count += 1

    def to(self, device: torch.device) -> None:
        if self.values.device != device:
            self.device = torch.device(device)
            self.values = self.values.to(self.device)

    def positions(self) -> torch.Tensor:
        """Chronological position (0 = oldest) of each slot, on the device."""
        index = torch.arange(self.size, device=self.device, dtype=self.values.dtype)
        return torch.remainder(index - self.count, self.size)

    def state_dict(self) -> dict:
        return {"values": self.values, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        """Restore a window; one saved with another ``size`` (``alpha_schedule.window`` changed on resume) keeps
        its newest ``min(old, new)`` values, in order."""
        values, count = state["values"].to(self.device, self.values.dtype), int(state["count"])
        old = values.shape[-1]
        if old == self.size:
            self.values, self.count = values.clone(), count
            return
        keep = min(count, old, self.size)
        order = torch.remainder(torch.arange(count - keep, count, device=self.device), old)
        self.values = torch.full_like(self.values, float("nan"))
        self.values[..., :keep] = values[..., order]
        self.count = keep

    def host_values(self) -> list[float]:
        """The window's values, oldest first (non-finite ones included as NaN). Syncs: checkpoints only."""
        order = torch.argsort(self.positions())
        return self.values[order][-min(self.count, self.size):].tolist() if self.count else []


def loss_statistics(window: DeviceWindow) -> dict[str, torch.Tensor]:
    """``loss_slope``, ``loss_r2``, ``loss_cv``, ``loss_improvement_rate``, ``loss_improvement_rate_se``,
    ``loss_improvement_rate_dof``, ``loss_samples`` of the window's finite values (formulas: module docstring) as
    0-dim device tensors. Device ops only; NaN where undefined."""
    return series_statistics(window.values[..., torch.argsort(window.positions())])


def _fit(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Least squares of the finite ``y`` on ``x`` over the last dim: (n, ȳ, Sxx, Sxy, Syy), from the raw sums (the
    sums against ``x`` as matrix products: a few passes over the window instead of a dozen)."""
    ok = torch.isfinite(y)
    w = ok.to(y.dtype)
    y0 = torch.where(ok, y, torch.zeros_like(y))
    n = w.sum(-1)
    if x.dim() == 1:
        sx, sxx, sxy = w @ x, w @ (x * x), y0 @ x
    else:  # one x per row (the blocks' mean positions)
        sx, sxx, sxy = (w * x).sum(-1), (w * x * x).sum(-1), (y0 * x).sum(-1)
    sy, syy = y0.sum(-1), (y0 * y0).sum(-1)
    x_mean, y_mean = sx / n, sy / n
    return (n, y_mean, torch.clamp(sxx - sx * x_mean, min=0.0), sxy - sx * y_mean,
            torch.clamp(syy - sy * y_mean, min=0.0))


def series_statistics(y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The window statistics of ``y`` (``(..., size)``, oldest first, non-finite values left out) over its last
    dim; any leading dims are independent windows (the property tests score hundreds of windows at once)."""
    size = y.shape[-1]
    x = torch.arange(size, device=y.device, dtype=y.dtype)
    n, y_mean, sxx, sxy, syy = _fit(y, x)
    slope = sxy / sxx
    r2 = torch.where(syy > 0, sxy * sxy / (sxx * syy), torch.zeros_like(syy))
    # batch means: the slope's standard error from BLOCKS block means, so correlation within a block (shared data
    # order, momentum, AR(1)-like per-step losses) does not shrink it; the newest BLOCKS x length values
    blocks = min(BLOCKS, size)
    length = size // blocks
    tail = y[..., size - blocks * length:].reshape(*y.shape[:-1], blocks, length)
    x_tail = x[size - blocks * length:].reshape(blocks, length)
    ok = torch.isfinite(tail)
    count = ok.sum(-1)
    block_mean = torch.where(ok, tail, torch.zeros_like(tail)).sum(-1) / count  # NaN for an empty block
    block_x = (ok * x_tail).sum(-1) / count
    block_x = torch.where(torch.isfinite(block_x), block_x, torch.zeros_like(block_x))
    nb, _, bxx, bxy, byy = _fit(block_mean, block_x)
    sse = torch.clamp(byy - bxy * bxy / bxx, min=0.0)
    se_slope = torch.sqrt(sse / ((nb - 2) * bxx))
    nan = torch.full_like(n, float("nan"))
    return {
        "loss_slope": slope,
        "loss_r2": r2,
        "loss_cv": torch.sqrt(syy / n) / y_mean.abs(),
        "loss_improvement_rate": -100.0 * slope / y_mean,
        "loss_improvement_rate_se": torch.where(nb > 2, 100.0 * se_slope / y_mean.abs(), nan),
        "loss_improvement_rate_dof": torch.where(nb > 2, nb - 2, nan),
        "loss_samples": n,
    }


def window_mean(window: DeviceWindow) -> torch.Tensor:
    """Mean of the window's finite values (NaN when it has none); device ops only."""
    ok = torch.isfinite(window.values)
    return torch.where(ok, window.values, torch.zeros_like(window.values)).sum(-1) / ok.sum(-1)


class SignAgreement:
    """Gradient sign agreement between consecutive optimizer steps of one expert (formula: module docstring).

    Keeps the signs of the previous step's gradients on their device (one float32 copy of the expert's LoRA
    gradients). :meth:`update` is a handful of fused ``_foreach`` kernels, no sync; :meth:`reset` forgets the
    previous step (the controller calls it when the expert stops training, which frees the memory).
    """

    def __init__(self) -> None:
        self.previous: list[torch.Tensor] | None = None
        self.sharded = False  # the gradients are FSDP's shards (update)

    def update(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Agreement of ``grads`` with the previous call's (None on the first call or when the tensor layout
        changed); remembers the signs of ``grads``."""
        grads = [g.detach() for g in grads]
        if not grads:
            return None
        groups = _shard_groups(grads[0])  # model.parallel = "fsdp": this rank's rows, the counts summed over ranks
        self.sharded = bool(groups)
        if groups:
            grads = [g.to_local() for g in grads]
        signs = torch._foreach_sign(grads)
        previous, self.previous = self.previous, signs
        if previous is not None and previous and previous[0].device != signs[0].device:
            previous = [p.to(signs[0].device) for p in previous]  # restored from a checkpoint on the CPU
        if previous is None or [p.shape for p in previous] != [s.shape for s in signs]:
            return None
        products = torch._foreach_mul(signs, previous)  # each element -1, 0 or +1
        dtype = _stat_dtype(signs[0].device)
        nonzero = torch.stack(torch._foreach_norm(products, 1)).to(dtype).sum()  # #{g·g' != 0}
        numel = sum(p.numel() for p in products)
        shifted = torch._foreach_add(products, 1.0)  # 0, 1, 2: its L1 norm is Σ(products) + numel
        total = torch.stack(torch._foreach_norm(shifted, 1)).to(dtype).sum() - numel
        if groups:  # every rank's rows (a device-side all-reduce per shard dimension, no host sync)
            import torch.distributed as dist

            counts = torch.stack([nonzero, total])
            for group in groups:
                dist.all_reduce(counts, group=group)
            nonzero, total = counts[0], counts[1]
        return (nonzero + total) / 2 / nonzero  # #{g·g' > 0} / #{g·g' != 0}

    def reset(self) -> None:
        self.previous = None

    def state_dict(self) -> dict:
        if self.sharded:  # a rank's own rows: not what another layout's rank holds; a resume skips one agreement
            return {"previous": None}
        return {"previous": list(self.previous) if self.previous is not None else None}

    def load_state_dict(self, state: dict) -> None:
        prev = state.get("previous")
        self.previous = None if prev is None else [t.clone() for t in prev]


def _shard_groups(tensor: torch.Tensor) -> list:
    """The process groups of the mesh dimensions ``tensor`` is sharded over (a ``DTensor`` of FSDP); empty for a
    plain tensor."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return []
    return [mesh.get_group(i) for i, placement in enumerate(tensor.placements) if placement.is_shard()]
