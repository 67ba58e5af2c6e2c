"""Fault injection (``[faults]``), a testing aid: out-of-memory errors, NaN losses and kills on purpose, so that
the out-of-memory guard, the non-finite guard and resume can be exercised on a CPU with a tiny model.

The training loop has no fault branch: :func:`inject_faults` wraps the model adapter's ``loss`` (forward and
backward faults, NaN losses, kills at a step), the optimizer's ``step`` (optimizer-phase faults) and the checkpoint
policy's writer (a kill between a checkpoint's rename and its ``CheckpointSaved`` event). Every decision is a pure
function of the config and the run's counters (``TrainState.step`` and ``micro_step``), never of a hidden random
state, so a resumed run meets exactly the faults the uninterrupted run met.
"""

from __future__ import annotations

import os
import signal
import types
from typing import Any

import numpy as np
import torch

from wantrain.core.state import TrainState


class InjectedOutOfMemory(torch.OutOfMemoryError):
    """An out-of-memory error raised by ``[faults]`` (the loop treats it like a real one)."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise InjectedOutOfMemory("out of memory (injected by [faults] in the backward pass)")


class FaultPlan:
    """When faults happen, from ``[faults]`` (a ``FaultsConfig``) and the live ``TrainState``."""

    def __init__(self, faults: Any, state: TrainState, rank: int = 0) -> None:
        self.cfg = faults
        self.state = state
        self.rank = rank
        self._first_micro = (0, 0)  # (step, its first micro-step)

    def _current_step(self) -> int:
        return self.state.step + 1

    def oom_now(self) -> bool:
        """Whether the current micro-step runs out of memory."""
        cfg, step, micro = self.cfg, self._current_step(), self.state.micro_step
        if self._first_micro[0] != step:
            self._first_micro = (step, micro)
        if cfg.oom_ranks and self.rank not in cfg.oom_ranks:
            return False
        if step in cfg.oom_at_steps and micro == self._first_micro[1]:
            return True
        if cfg.oom_probability > 0:
            # stateless per micro-step: the same micro-step draws the same number on every run and after a resume
            return bool(np.random.default_rng([cfg.seed, micro]).random() < cfg.oom_probability)
        return False

    def nan_now(self) -> bool:
        return self._current_step() in self.cfg.nan_at_steps

    def kill_now(self) -> None:
        """SIGKILL this process at the first micro-step of a step in ``kill_at_steps`` (``kill_phase = "step"``)."""
        cfg, step = self.cfg, self._current_step()
        first = self._first_micro == (step, self.state.micro_step)
        if cfg.kill_phase == "step" and step in cfg.kill_at_steps and first:
            os.kill(os.getpid(), signal.SIGKILL)


class FaultyAdapter:
    """Wraps a model adapter; everything but ``loss`` is delegated unchanged."""

    def __init__(self, adapter: Any, plan: FaultPlan) -> None:
        self._adapter = adapter
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def loss(self, batch: Any, expert: Any, generator: torch.Generator) -> torch.Tensor:
        plan = self._plan
        oom = plan.cfg.oom_phase != "optimizer" and plan.oom_now()  # oom_now() first: it tracks the first micro-step
        plan.kill_now()
        if oom and plan.cfg.oom_phase == "forward":
            raise InjectedOutOfMemory("out of memory (injected by [faults] in the forward pass)")
        loss = self._adapter.loss(batch, expert, generator)
        if plan.nan_now():
            loss = loss * float("nan")
        if oom:
            loss = _RaiseInBackward.apply(loss)
        return loss


def inject_faults(adapter: Any, optimizer: torch.optim.Optimizer, faults: Any, state: TrainState,
                  rank: int = 0, checkpoints: Any = None) -> Any:
    """Return the adapter to train with: ``adapter`` itself when ``faults`` is inactive, else a wrapper. With
    ``oom_phase = "optimizer"`` the optimizer's ``step`` is wrapped in place; with ``kill_phase =
    "after_checkpoint"`` the writer of ``checkpoints`` (a ``CheckpointPolicy``) is. ``rank``: this process's
    torchrun rank (``faults.oom_ranks``)."""
    if not faults.active:
        return adapter
    plan = FaultPlan(faults, state, rank)
    if faults.kill_at_steps and faults.kill_phase == "after_checkpoint" and checkpoints is not None:
        write = checkpoints.write

        def write_then_kill(directory: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            path = write(directory, step, *args, **kwargs)
            if step in faults.kill_at_steps:
                os.kill(os.getpid(), signal.SIGKILL)  # renamed into place, CheckpointSaved not yet emitted
            return path

        checkpoints.write = write_then_kill
    if faults.oom_phase == "optimizer":
        original = optimizer.step

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if plan.oom_now():
                raise InjectedOutOfMemory("out of memory (injected by [faults] in optimizer.step)")
            return original(*args, **kwargs)

        # a bound method, as torch's LR schedulers expect when they wrap ``step`` themselves
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    return FaultyAdapter(adapter, plan)
