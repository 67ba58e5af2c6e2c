"""Built-in schedules as pure functions of the optimizer step.

``lr(step)`` for a run of ``total_steps`` optimizer steps (step 0 is the LR of the first optimizer step):

* warmup, steps ``0 <= s < W``: ``lr = main(0) * (f + (1 - f) * s / W)`` with ``f = warmup_start_factor``, so
  step 0 uses ``f * main(0)`` and step ``W`` is the first at the schedule's start value;
* then the main schedule at ``t = s - W`` over the horizon ``H = total_steps - W``:

  - ``constant``: ``base``;
  - ``linear``: ``base * (start_factor + (end_factor - start_factor) * min(t, L) / L)``, ``L = total_iters or H``;
  - ``cosine``: one cycle of length ``H`` from ``base`` towards ``eta_min`` (no rebound past ``H``);
  - ``cosine_annealing_warm_restarts_decay``: cycle ``k`` has length ``round(T_0 * T_mult**k)`` (halves round up,
    at least 1) and peak ``p_k = base * gamma**k``; within it ``lr = p_k*w + lo_k*(1-w)`` with
    ``w = (1 + cos(pi * t_cur / T_k)) / 2`` and floor ``lo_k = min(eta_min, p_k)``, so the LR at a restart is
    exactly ``p_k`` and never exceeds it; after ``cycle_limit`` cycles the LR stays at the last floor.

The scheduler's whole state is its step count, so a resumed run reproduces the LR sequence exactly.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
from typing import Any

from wantrain.core.errors import ConfigError
from wantrain.schedulers.config import TABLE, SchedulerConfig, warmup_steps_for

log = logging.getLogger("wantrain.schedulers")


class _Cycles:
    """Start steps of the restart cycles, extended on demand (cycle lengths are whole steps)."""

    def __init__(self, t0: int, t_mult: float) -> None:
        self.t0 = t0
        self.t_mult = float(t_mult)
        self.starts = [0]
        self.lengths: list[int] = []

    def _length(self, k: int) -> int:
        return max(1, math.floor(self.t0 * self.t_mult**k + 0.5))

    def locate(self, t: int) -> tuple[int, int, int]:
        """``(cycle index, step within the cycle, cycle length)`` of main-schedule step ``t >= 0``."""
        if self.t_mult == 1.0:
            k, t_cur = divmod(t, self.t0)
            return k, t_cur, self.t0
        while self.starts[-1] <= t:
            length = self._length(len(self.lengths))
            self.lengths.append(length)
            self.starts.append(self.starts[-1] + length)
        k = bisect.bisect_right(self.starts, t) - 1
        return k, t - self.starts[k], self.lengths[k]

    def start(self, k: int) -> int:
        if self.t_mult == 1.0:
            return k * self.t0
        while len(self.starts) <= k:
            length = self._length(len(self.lengths))
            self.lengths.append(length)
            self.starts.append(self.starts[-1] + length)
        return self.starts[k]


@functools.lru_cache(maxsize=32)
def _cycles(t0: int, t_mult: float) -> _Cycles:
    return _Cycles(t0, t_mult)


def _cosine(peak: float, floor: float, t_cur: int, length: int) -> float:
    lo = min(floor, peak)
    w = 0.5 * (1.0 + math.cos(math.pi * t_cur / length))
    return min(peak, max(lo, peak * w + lo * (1.0 - w)))


def main_lr(cfg: SchedulerConfig, base_lr: float, t: int, horizon: int) -> float:
    """The schedule after warmup at its own step ``t`` (0-based), over ``horizon`` steps."""
    kind = cfg.type
    if kind == "constant":
        return base_lr
    if kind == "linear":
        length = cfg.get("total_iters") or horizon
        start, end = cfg.get("start_factor"), cfg.get("end_factor")
        return base_lr * (start + (end - start) * min(t, length) / length)
    if kind == "cosine":
        eta_min = cfg.get("eta_min")
        if t >= horizon:
            return min(eta_min, base_lr)
        return _cosine(base_lr, eta_min, t, horizon)
    if kind == "cosine_annealing_warm_restarts_decay":
        eta_min, gamma, limit = cfg.get("eta_min"), cfg.get("gamma"), cfg.get("cycle_limit")
        k, t_cur, length = _cycles(cfg.T_0, float(cfg.get("T_mult"))).locate(t)
        if limit is not None and k >= limit:
            return min(eta_min, base_lr * gamma ** (limit - 1))
        return _cosine(base_lr * gamma**k, eta_min, t_cur, length)
    raise ValueError(f"lr_at covers the built-in types, not {kind!r}")  # external: build it and step it


def lr_at(cfg: SchedulerConfig, base_lr: float, step: int, total_steps: int) -> float:
    """The LR of optimizer step ``step`` (0-based) of a run of ``total_steps`` for a group with base LR
    ``base_lr``. Pure; built-in types only. Raises ``ConfigError`` if the warmup leaves no step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = warmup_steps_for(cfg, total_steps)
    horizon = total_steps - warmup
    if step >= warmup:
        return main_lr(cfg, base_lr, step - warmup, horizon)
    f = cfg.get("warmup_start_factor")
    return main_lr(cfg, base_lr, 0, horizon) * (f + (1.0 - f) * step / warmup)


def restart_steps(cfg: SchedulerConfig, total_steps: int) -> list[tuple[int, int]]:
    """``(step, cycle index)`` of each restart within the run (cycle index >= 1), for previews."""
    if cfg.type != "cosine_annealing_warm_restarts_decay":
        return []
    warmup = warmup_steps_for(cfg, total_steps)
    cycles = _cycles(cfg.T_0, float(cfg.get("T_mult")))
    limit = cfg.get("cycle_limit")
    out = []
    k = 1
    while limit is None or k < limit:
        s = warmup + cycles.start(k)
        if s >= total_steps:
            break
        out.append((s, k))
        k += 1
    return out


def cycle_limit_step(cfg: SchedulerConfig, total_steps: int) -> int | None:
    """The first step after the last allowed cycle, when it falls within the run."""
    limit = cfg.get("cycle_limit") if cfg.type == "cosine_annealing_warm_restarts_decay" else None
    if limit is None:
        return None
    s = warmup_steps_for(cfg, total_steps) + _cycles(cfg.T_0, float(cfg.get("T_mult"))).start(limit)
    return s if s < total_steps else None


class ClosedFormScheduler:
    """A built-in schedule bound to an optimizer. State: the number of optimizer steps taken.

    Construction sets every group's LR to ``lr(0)``; after ``k`` calls of :meth:`step` the groups hold ``lr(k)``.
    Each group keeps its own base LR (``initial_lr`` if present, else its ``lr`` at construction; the base is
    stored back as ``initial_lr`` so that it travels with the optimizer's state dict). Host-only arithmetic: no
    device sync.
    """

    def __init__(self, cfg: SchedulerConfig, optimizer: Any, *, total_steps: int) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.cfg = cfg
        self.optimizer = optimizer
        self.total_steps = total_steps
        warmup_steps_for(cfg, total_steps)  # report an impossible warmup now, not at the first step
        self.base_lrs = []
        for group in optimizer.param_groups:
            base = float(group.setdefault("initial_lr", group["lr"]))
            self.base_lrs.append(base)
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = lr_at(self.cfg, base, self.last_step, self.total_steps)

    def step(self) -> None:
        """Advance one optimizer step (call after ``optimizer.step()``, once per optimizer step)."""
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "closed_form", "type": self.cfg.type, "step": self.last_step,
                "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "closed_form":
            raise ConfigError(
                f"the saved LR scheduler is an external {state.get('class')!r} but {TABLE}.type is "
                f"{self.cfg.type!r}; resume with the schedule the run was started with"
            )
        if state.get("type") != self.cfg.type or state.get("total_steps") != self.total_steps:
            log.warning(
                "lr_scheduler: resuming a %s schedule over %s steps as %s over %s steps; the LR follows the new one",
                state.get("type"), state.get("total_steps"), self.cfg.type, self.total_steps,
            )
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"scheduler state has an invalid step {step!r}")
        self.last_step = step
        self._apply()
