"""The core's own bookkeeping of one log interval: the losses of its micro-steps and the non-finite guard's
flags, kept on the device without any work per step, and turned into metrics on the host at the log step from the
same single transfer as every observer's values (``DeviceMetrics.gather``).

Per optimizer step the guard costs ONE device op: :meth:`LogInterval.check_finite` runs GradScaler's own kernel
(``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1.0, which leaves the values as they are),
which writes 1.0 into the step's flag when a loss of the step or the gradient norm is NaN or infinite. The fused
optimizer reads that flag as ``found_inf`` and skips the step inside its kernel: no sync. The flags are views into
one buffer per interval (allocated once per interval); the losses are the detached loss tensors themselves
(references: no copy, no op).

At the log step (host values, so replaying the event log reproduces every decision made from them):

* ``train/loss`` -- mean of the interval's finite micro-step losses; absent when none was finite.
* ``train/loss/<expert>`` -- the same per expert.
* ``train/nan_skipped_steps`` -- optimizer steps skipped as non-finite since the run started.
* ``train/lora_norm`` -- with ``train.divergence_factor`` set only: the L2 norm of every trainable LoRA tensor;
  ``train/lora_norm_start``, at the first log step of a fresh run only: the same before the first step
  (:class:`DivergenceGuard`).
* ``train/nan_streak_max`` -- the longest run of consecutive non-finite steps reached at a step of the interval
  (a streak that began in an earlier interval counts from its start; one that ended at the previous log step is
  not counted again).

Sums are taken in float64 on the host, value by value in step order, so a run resumed from a checkpoint taken
between log steps logs the same numbers as the uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

_LOSS = "train/loss"


class LogInterval:
    """Losses and non-finite flags of the current log interval (device tensors), and the guard's host counters.

    ``capacity``: optimizer steps per interval (``log_every``); a longer interval (a changed ``log_every`` on
    resume) allocates another buffer.
    """

    def __init__(self, device: torch.device | str, capacity: int, divergence_factor: float | None = None) -> None:
        self.device = torch.device(device)
        self.divergence = DivergenceGuard(divergence_factor)
        self.capacity = max(1, int(capacity))
        self._one = torch.ones((), device=self.device)
        self._losses: list[torch.Tensor] = []
        self._experts: list[str | None] = []
        self._chunks: list[torch.Tensor] = []  # flag buffers of this interval, filled in order
        self._views: tuple[torch.Tensor, ...] = ()  # 0-dim views of the last chunk
        self._used = 0  # views of the last chunk handed out
        # host counters, updated at each log step (and restored from checkpoints); streak_max is the interval's
        # longest streak before its flags (nonzero only when restored from an older checkpoint)
        self.nan_skipped = 0
        self.streak = 0
        self.streak_max = 0
        self._carried: dict[str, list[float]] = {}  # name -> [sum, count] from an older checkpoint format

    # -- per micro-step and optimizer step (no sync) -------------------------------------------------------------
    def add_loss(self, loss: torch.Tensor, expert: str | None) -> None:
        """Keep a micro-step's detached loss (a reference; no device op)."""
        self._losses.append(loss)
        self._experts.append(expert)

    def next_flag(self) -> torch.Tensor:
        """The 0-dim float32 flag of the next optimizer step (0.0 until :meth:`check_finite` finds a non-finite
        value). It is what the fused optimizer gets as ``found_inf``."""
        if self._used == len(self._views):
            chunk = torch.zeros(self.capacity, device=self.device)
            self._chunks.append(chunk)
            self._views, self._used = chunk.unbind(0), 0
        flag = self._views[self._used]
        self._used += 1
        return flag

    def check_finite(self, tensors: list[torch.Tensor], flag: torch.Tensor) -> None:
        """Set ``flag`` to 1.0 if any of ``tensors`` holds a NaN or an infinity (one fused device op, no sync;
        the tensors are multiplied by 1.0 in place, which changes no value)."""
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self._one)

    # -- log step ------------------------------------------------------------------------------------------------
    def device_parts(self) -> list[torch.Tensor]:
        """1-D device tensors to travel with the log step's single transfer: the losses, then the flags."""
        parts = []
        if self._losses:
            parts.append(torch.stack(self._losses))
        parts.extend(self._flag_tensors())
        return parts

    def close(self, host: list[float]) -> dict[str, float]:
        """The interval's metrics from the host values of :meth:`device_parts` (in the same order), then start
        the next interval."""
        losses, flags = host[:len(self._losses)], host[len(self._losses):]
        sums: dict[str, list[float]] = {name: list(v) for name, v in self._carried.items()}
        for loss, expert in zip(losses, self._experts, strict=True):
            if math.isfinite(loss):
                for name in (_LOSS, f"{_LOSS}/{expert}") if expert is not None else (_LOSS,):
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0] += loss
                    acc[1] += 1.0
        out = {name: total / count for name, (total, count) in sums.items() if count > 0}
        streak_max = self.streak_max
        for flag in flags:
            if flag > 0:
                self.streak += 1
                self.nan_skipped += 1
                streak_max = max(streak_max, self.streak)
            else:
                self.streak = 0
        out["train/nan_skipped_steps"] = float(self.nan_skipped)
        out["train/nan_streak_max"] = float(streak_max)
        self.streak_max = 0
        self._reset()
        return out

    def _flag_tensors(self) -> list[torch.Tensor]:
        if not self._chunks:
            return []
        *full, last = self._chunks
        return [*full, last[:self._used]] if self._used < len(last) else list(self._chunks)

    def _reset(self) -> None:
        self._losses, self._experts, self._carried = [], [], {}
        self._chunks, self._views, self._used = [], (), 0

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The interval so far (for a checkpoint taken between log steps) and the guard's counters."""
        flags = self._flag_tensors()
        return {
            "losses": torch.stack(self._losses).float() if self._losses else None,
            "experts": list(self._experts),
            "flags": torch.cat(flags) if flags else None,
            "nan_skipped": self.nan_skipped, "streak": self.streak, "streak_max": self.streak_max,
            "carried": {name: list(v) for name, v in self._carried.items()},
            "divergence_baseline": self.divergence.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reset()
        if state.get("losses") is not None:
            self._losses = list(state["losses"].to(self.device).unbind(0))
            self._experts = list(state["experts"])
        if state.get("flags") is not None:
            chunk = state["flags"].to(self.device, torch.float32).clone()
            self._chunks, self._views, self._used = [chunk], chunk.unbind(0), len(chunk)
        self.nan_skipped, self.streak = int(state["nan_skipped"]), int(state["streak"])
        self.streak_max = int(state["streak_max"])
        self._carried = {name: [float(s), float(c)] for name, (s, c) in state.get("carried", {}).items()}
        self.divergence.load_state_dict(state.get("divergence_baseline", {}))  # none in older checkpoints

    def load_legacy(self, guard: Mapping[str, Any], metric_sums: dict[str, Any]) -> None:
        """Restore from a checkpoint written before this class existed (its ``nonfinite_guard`` device counters;
        running loss sums in ``DeviceMetrics``): the ``train/loss*`` entries (``{"total", "count"}``) are taken out
        of ``metric_sums`` and carried into this interval's means."""
        self._reset()
        self.nan_skipped, self.streak = int(guard["skipped"]), int(guard["streak"])
        self.streak_max = int(guard["streak_max"])
        for name in [n for n in metric_sums if n == _LOSS or n.startswith(f"{_LOSS}/")]:
            entry = metric_sums.pop(name)
            self._carried[name] = [float(entry["total"]), float(entry["count"])]


LORA_NORM = "train/lora_norm"
LORA_NORM_START = "train/lora_norm_start"


class DivergenceGuard:
    """The non-finite guard's sibling for losses that grow but stay finite (``train.divergence_factor``).

    At each log step, from host values that reach the event log (so replay reproduces the decision): each of
    ``train/loss``, ``train/loss/<expert>`` (the interval's mean: smoothed, never a single step) and
    ``train/lora_norm`` (the L2 norm of every trainable LoRA tensor, computed on the device at log steps only and
    sent with the log step's single transfer) is compared with its *baseline*: for the losses their first logged
    value in the run, for the norm the LoRA's norm before the first step (``train/lora_norm_start``, logged once,
    at the first log step: a high learning rate may grow the LoRA tenfold within the first interval).
    A value above ``factor`` times its baseline trips the guard: :meth:`check` returns what grew, and the loop
    stops the run as failed (exit code 1), saving nothing, so the last checkpoint is the last good one. Baselines
    travel in checkpoints (a resumed run compares with the original run's early values)."""

    def __init__(self, factor: float | None) -> None:
        self.factor = factor
        self.baseline: dict[str, float] = {}

    @staticmethod
    def watches(name: str) -> bool:
        return name in (_LOSS, LORA_NORM) or name.startswith(f"{_LOSS}/")

    def check(self, values: Mapping[str, float]) -> str | None:
        """What diverged at this log step (one line), or None; the first value of each metric becomes its
        baseline."""
        if self.factor is None:
            return None
        if LORA_NORM_START in values:
            self.baseline.setdefault(LORA_NORM, values[LORA_NORM_START])
        for name, value in values.items():
            if not self.watches(name) or not math.isfinite(value):
                continue
            base = self.baseline.setdefault(name, value)
            if base > 0 and value > self.factor * base:
                return (f"{name} = {value:.4g} is {value / base:.0f}x its first logged value {base:.4g} (more than "
                        f"train.divergence_factor = {self.factor:g})")
        return None

    def state_dict(self) -> dict[str, float]:
        return dict(self.baseline)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.baseline = {name: float(v) for name, v in state.items()}
