"""The control object: observers request, the core acts.

Observers never change the model, the optimizer or the loop themselves; they set requests here and the core reads
them at fixed points (see the pseudocode in ``wantrain.core.events``):

* ``request_stop`` -- read after every micro-step and after every optimizer step. Sticky: once raised it stays
  raised for the rest of the run, whoever asks next (Lightning's ``should_stop`` lesson).
* ``request_save`` -- read after each optimizer step; cleared when the core has saved.
  A person's requests (``wantrain ctl``, ``wantrain serve``'s buttons) come through the run's inbox
  (``core.inbox``): the core records each one as ``ControlRequested`` and turns ``save`` and ``stop`` into
  ``request_save`` and ``request_stop``.
* ``skip_optimizer_step`` -- read right before the optimizer step (after ``GradsReady``); cleared after that
  step. The gradients are dropped and the scheduler still advances, so the schedule stays a function of the step.
* ``set_lr`` -- per parameter group (by name); a group that follows another (``follows``/``lr_ratio`` in its
  param group: LoRA+'s ``<group>_B``) gets ``lr_ratio`` x its leader's LR unless set itself; applied right before
  the next optimizer step, then cleared, so it
  overrides the scheduler for that one step: after ``optimizer.step()`` and before ``scheduler.step()`` the core
  puts the group's scheduled LR back, so schedulers that compute the next LR from the current one (ExponentialLR,
  StepLR) continue as if there had been no override. An observer that wants to hold an LR sets it at every step.
  Refused at the call (``ValueError``): an LR that is not a finite number >= 0, and a group name not in
  ``group_names``, which the trainer fills in when it is built (until then any name is accepted).
* ``set_generator_state`` -- the state (from ``ctx.generator.get_state()``) the trainer's generator is set to right
  before the next forward pass, then cleared: that micro-step draws its timesteps and noise as it did when the
  state was read. The LR finder uses it to give every LR the same draws. It changes what the run computes, like
  ``set_lr``; the generator state is saved in checkpoints as usual.
* ``set_lora_alpha`` -- a LoRA alpha transition of one expert (the alpha controller decides it from a log step's
  ``MetricsLogged``). Applied by the core after each optimizer step's events (``OptimizerStepped`` and, on a log
  step, ``MetricsLogged`` with what its handlers emitted) and before any save of that step, in the order asked,
  then cleared: the core calls the adapter's ``change_lora_alpha`` (``core.adapter.AlphaChangeable``) with the
  optimizer, whose moments follow a ``preserve_output`` rescale. Refused at the call (``ValueError``): an alpha
  that is not a finite number > 0.
* ``evaluation()`` -- a context for evaluating the model between optimizer steps (validation, samples), from
  handlers of ``RunStarted``, ``OptimizerStepped``, ``MetricsLogged``, ``CheckpointSaved``, ``ControlRequested``:
  inside it the model is in eval mode under ``torch.no_grad`` and ``bring_in(expert)`` (what the context yields)
  has the core move that expert with its optimizer state onto the training device and the others off it; on exit,
  also after an error, the expert that was training is back and train mode is restored. Unlike the other requests
  it acts at once: the handler's evaluation runs inside it. Needs ``core.adapter.Evaluating``; outside a run (no
  trainer bound), ``core.adapter.evaluation_session(adapter)`` does the same without an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs

BringIn = Callable[[Any], None]
"""``bring_in(expert)``: what :meth:`Control.evaluation` yields."""


@attrs.define
class Control:
    """Requests raised by observers. Read by the core only."""

    _stop_reason: str | None = None
    _save_reason: str | None = None
    _skip_reason: str | None = None
    _lr_requests: dict[str, float] = attrs.field(factory=dict)
    _generator_state: Any = None
    _alpha_requests: list[tuple[Any, float, bool]] = attrs.field(factory=list)
    _evaluation: Callable[[], AbstractContextManager[BringIn]] | None = None  # bound by the trainer
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

    # -- LoRA alpha ----------------------------------------------------------------------------------------------
    def set_lora_alpha(self, expert: Any, alpha: float, *, preserve_output: bool) -> None:
        """Ask for ``expert``'s LoRA alpha to become ``alpha`` after this optimizer step's events, before its saves
        (``preserve_output``: keep the model's function, rescaling ``B`` and its optimizer state)."""
        try:
            value = float(alpha)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"set_lora_alpha({expert!r}, {alpha!r}): alpha must be a finite number > 0")
        self._alpha_requests.append((expert, value, bool(preserve_output)))

    @property
    def has_model_requests(self) -> bool:
        """Whether a request that the core applies after a step's events is pending (one list check)."""
        return bool(self._alpha_requests)

    def take_alpha_requests(self) -> list[tuple[Any, float, bool]]:
        """``(expert, alpha, preserve_output)`` in the order asked; cleared."""
        requests, self._alpha_requests = self._alpha_requests, []
        return requests

    # -- experts brought in for an evaluation ----------------------------------------------------------------------
    def bind_evaluation(self, factory: Callable[[], AbstractContextManager[BringIn]]) -> None:
        """The trainer's: ``factory()`` opens an evaluation of its model with its optimizer."""
        self._evaluation = factory

    def evaluation(self) -> AbstractContextManager[BringIn]:
        """Evaluate between optimizer steps: ``with ctx.control.evaluation() as bring_in: bring_in(expert); ...``
        (see the module docstring)."""
        if self._evaluation is None:
            raise RuntimeError("control.evaluation(): no trainer is bound to this control object; outside a run use "
                               "wantrain.core.adapter.evaluation_session(adapter)")
        return self._evaluation()
