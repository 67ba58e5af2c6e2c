"""Timestep sampling for flow matching, restricted to an expert's band without distorting the distribution.

t is drawn from a base distribution (uniform, logit-normal or sigmoid-of-normal), then shifted:
``t' = s*t / (1 + (s-1)*t)``. An expert trains only the band ``[low, high]`` of t'. Because the shift and the
base CDF are monotonic and have closed-form inverses, the band maps to an interval ``[F(u_low), F(u_high)]`` of
the base CDF; we draw u uniformly in that interval and apply the inverse CDF and the shift. The result is
exactly the shifted distribution conditioned on the band (what rejection sampling gives, and what diffusion-pipe
approximates with a 10,000-quantile table), with no rejection loop, no linear rescale, and no host sync.
"""

from __future__ import annotations

import math

import attrs
import torch

# Low-noise band ends just below the boundary: the pipelines route t*1000 >= boundary*1000 to the high-noise
# expert, so t must stay strictly below it.
_BELOW_BOUNDARY = 1e-6


def shift_t(t: torch.Tensor | float, shift: float):
    """The timestep shift ``s*t / (1 + (s-1)*t)`` (identity for s = 1)."""
    return shift * t / (1 + (shift - 1) * t)


def unshift_t(t: float, shift: float) -> float:
    """Inverse of :func:`shift_t`: the base t whose shifted value is ``t``."""
    return t / (shift - (shift - 1) * t)


@attrs.frozen(kw_only=True)
class Band:
    """An inclusive range of t (0-1 units, after the shift)."""

    low: float
    high: float


def expert_band(boundary: float | None, expert: str | None, min_t: float | None, max_t: float | None) -> Band:
    """The band of t trained for ``expert``: high noise owns t >= boundary, low noise t < boundary.

    ``min_t``/``max_t`` narrow it (the config has already checked that they lie inside the expert's range).
    """
    low, high = 0.0, 1.0
    if boundary is not None and expert == "high_noise":
        low = boundary
    elif boundary is not None and expert == "low_noise":
        high = boundary - _BELOW_BOUNDARY
    if min_t is not None:
        low = max(low, min_t)
    if max_t is not None:
        high = min(high, max_t)
    return Band(low=low, high=high)


@attrs.frozen(kw_only=True)
class TimestepSampler:
    """Draws t in a band. ``method`` is ``uniform``, ``logit_normal`` (sigmoid of N(mean, std)) or ``sigmoid``
    (sigmoid of scale * N(0, 1), i.e. logit-normal with mean 0 and std = scale)."""

    method: str
    shift: float = 1.0
    mean: float = 0.0
    std: float = 1.0

    def base_cdf(self, t: float) -> float:
        """P(base t <= ``t``) before the shift."""
        if self.method == "uniform":
            return min(max(t, 0.0), 1.0)
        if t <= 0.0:
            return 0.0
        if t >= 1.0:
            return 1.0
        z = (math.log(t / (1 - t)) - self.mean) / self.std
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def share_above(self, boundary: float) -> float:
        """P(t' >= boundary): the share of steps the high-noise expert would get if t were drawn over the whole
        range and routed like the pipelines do (docs/models.md tabulates it)."""
        return 1.0 - self.base_cdf(unshift_t(boundary, self.shift))

    def sample(self, n: int, band: Band, generator: torch.Generator, device: torch.device,
               quantile: float | None = None) -> torch.Tensor:
        """``n`` values of t in ``band`` (float64 on ``device``: cast ``t * 1000`` to the model dtype *after*
        scaling, so that t = 0.9 stays >= the 900 boundary). Random numbers come from ``generator`` only, so a
        fixed generator state gives fixed timesteps. No host sync.

        ``quantile`` (in [0, 1)): draw no t at random but place value k at quantile ``(quantile + k/n) mod 1`` of
        the band's distribution (the generator still advances as usual). The LR finder's stratified sweep uses it."""
        u_low = self.base_cdf(unshift_t(band.low, self.shift))
        u_high = self.base_cdf(unshift_t(band.high, self.shift))
        u = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)
        if quantile is not None:
            u = ((quantile + torch.arange(n, dtype=torch.float64, device=u.device) / n) % 1.0)
        u = (u_low + u * (u_high - u_low)).to(device)
        if self.method == "uniform":
            base = u
        else:
            base = torch.sigmoid(self.mean + self.std * torch.special.ndtri(u))
        return shift_t(base, self.shift).clamp(band.low, band.high)
