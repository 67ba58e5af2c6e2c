"""The control object: observers request, the core acts.

Observers never change the model, the optimizer or the loop themselves; they set requests here and the core reads
them at fixed points (see the pseudocode in ``wantrain.core.events``):

* ``request_stop`` -- read after every micro-step and after every optimizer step. Sticky: once raised it stays
  raised for the rest of the run, whoever asks next (Lightning's ``should_stop`` lesson).
* ``request_save`` -- read after each optimizer step; cleared when the core has saved.
* ``skip_optimizer_step`` -- read right before the optimizer step (after ``GradsReady``); cleared after that
  step. The gradients are dropped and the scheduler still advances, so the schedule stays a function of the step.
* ``set_lr`` -- per parameter group (by name); applied right before the next optimizer step, then cleared, so it
  overrides the scheduler for that one step: after ``optimizer.step()`` and before ``scheduler.step()`` the core
  puts the group's scheduled LR back, so schedulers that compute the next LR from the current one (ExponentialLR,
  StepLR) continue as if there had been no override. An observer that wants to hold an LR sets it at every step.
  Refused at the call (``ValueError``): an LR that is not a finite number >= 0, and a group name not in
  ``group_names``, which the trainer fills in when it is built (until then any name is accepted).
* ``set_generator_state`` -- the state (from ``ctx.generator.get_state()``) the trainer's generator is set to right
  before the next forward pass, then cleared: that micro-step draws its timesteps and noise as it did when the
  state was read. The LR finder uses it to give every LR the same draws. It changes what the run computes, like
  ``set_lr``; the generator state is saved in checkpoints as usual.
"""

from __future__ import annotations

import math
from typing import Any

import attrs


@attrs.define
class Control:
    """Requests raised by observers. Read by the core only."""

    _stop_reason: str | None = None
    _save_reason: str | None = None
    _skip_reason: str | None = None
    _lr_requests: dict[str, float] = attrs.field(factory=dict)
    _generator_state: Any = None
    group_names: tuple[str, ...] | None = None  # the optimizer's parameter groups, set by the trainer

    # -- stop (sticky) -----------------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask the core to end the run after the current micro-step. Cannot be withdrawn."""
        if self._stop_reason is None:
            self._stop_reason = reason

    @property
    def stop_requested(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    # -- save now ----------------------------------------------------------------------------------------------
    def request_save(self, reason: str) -> None:
        """Ask for a LoRA save after the current optimizer step."""
        self._save_reason = self._save_reason or reason

    @property
    def has_save_request(self) -> bool:
        return self._save_reason is not None

    def take_save_request(self) -> str | None:
        reason, self._save_reason = self._save_reason, None
        return reason

    # -- skip this optimizer step ------------------------------------------------------------------------------
    def skip_optimizer_step(self, reason: str) -> None:
        """Ask the core not to apply the current optimizer step (valid until that step is taken)."""
        self._skip_reason = self._skip_reason or reason

    def take_skip_request(self) -> str | None:
        reason, self._skip_reason = self._skip_reason, None
        return reason

    # -- learning rate per parameter group ---------------------------------------------------------------------
    def set_lr(self, group: str, lr: float) -> None:
        """Ask for learning rate ``lr`` on parameter group ``group`` at the next optimizer step only."""
        try:
            value = float(lr)  # numpy and 0-d torch scalars too
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"set_lr({group!r}, {lr!r}): learning rate must be a finite number >= 0")
        if self.group_names is not None and group not in self.group_names:
            raise ValueError(
                f"set_lr({group!r}, {lr!r}): no parameter group {group!r}; the groups are "
                + ", ".join(repr(name) for name in self.group_names)
            )
        self._lr_requests[group] = value

    def take_lr_requests(self) -> dict[str, float]:
        requests, self._lr_requests = self._lr_requests, {}
        return requests

    # -- random draws of the next forward pass -----------------------------------------------------------------
    def set_generator_state(self, state: Any) -> None:
        """Ask for the trainer's generator to be set to ``state`` (a ``torch.Generator.get_state()`` tensor) right
        before the next forward pass only."""
        self._generator_state = state

    def take_generator_state(self) -> Any:
        state, self._generator_state = self._generator_state, None
        return state
