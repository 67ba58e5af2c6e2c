"""The training loop. Read ``Trainer.run`` top to bottom; ``wantrain.core.events`` has the same loop as
pseudocode with every event in place.

Every feature lives elsewhere: logging, metrics, LR finding, alpha control and checkpoint formats are observers
or the saver. The loop only emits events, reads the control object at fixed points, and gathers host values once
per log interval.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.adapter import ModelAdapter, NullSaver, Saver
from wantrain.core.bus import Bus
from wantrain.core.context import Context, DeviceMetrics, Live
from wantrain.core.control import Control
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import (
    CheckpointSaved,
    ExpertSwitched,
    GradsReady,
    LossComputed,
    MetricsLogged,
    OptimizerStepped,
    OutOfMemory,
    RunEnded,
    RunStarted,
    StepStarted,
)
from wantrain.core.state import TrainState


@attrs.frozen(kw_only=True)
class LoopSettings:
    """What the loop needs from ``[train]`` (``TrainConfig`` satisfies it)."""

    max_steps: int
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    log_every: int = 10
    save_every: int | None = None
    max_consecutive_oom: int = 3

    @classmethod
    def from_config(cls, train: Any) -> LoopSettings:
        return cls(**{f.name: getattr(train, f.name) for f in attrs.fields(cls)})


@attrs.frozen
class RunResult:
    status: str
    reason: str | None
    steps: int
    saved: tuple[str, ...]


class _StopMicroSteps(Exception):
    """Internal: the micro-step loop ended early (stop request or out of memory)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA/MPS/CPU allocator out-of-memory errors."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


class Trainer:
    """Runs optimizer steps ``state.step+1 .. settings.max_steps`` over ``batches`` and emits events on ``bus``.

    The trainer is handed ready-made parts (the CLI assembles them from the config): a :class:`ModelAdapter`,
    an iterable of batches (infinite, or at least long enough), an optimizer over ``adapter.param_groups()``, a
    scheduler with ``step()`` (called once per optimizer step) and a :class:`Saver`.
    """

    def __init__(
        self,
        *,
        adapter: ModelAdapter,
        batches: Iterable[Mapping[str, Any]],
        optimizer: torch.optim.Optimizer,
        settings: LoopSettings,
        scheduler: Any = None,
        saver: Saver | None = None,
        bus: Bus | None = None,
        run_dir: Path | None = None,
        config: Any = None,
        seed: int = 0,
        state: TrainState | None = None,
    ) -> None:
        self.adapter = adapter
        self.batches = batches
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.saver = saver or NullSaver()
        self.settings = settings
        self.state = state or TrainState()
        self.state.total_steps = settings.max_steps
        self.ctx = Context(
            control=Control(), state=self.state, metrics=DeviceMetrics(), live=Live(), run_dir=run_dir,
            config=config, adapter=adapter, optimizer=optimizer, scheduler=scheduler,
        )
        self.bus = bus if bus is not None else Bus()
        self.bus.ctx = self.ctx
        self.generator = torch.Generator(device=adapter.device).manual_seed(seed)
        self._group_names = tuple(g.get("name", str(i)) for i, g in enumerate(optimizer.param_groups))
        self.ctx.control.group_names = self._group_names
        self._saved: list[str] = []

    @property
    def control(self) -> Control:
        return self.ctx.control

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        state, control, s = self.state, self.ctx.control, self.settings
        status, reason = "completed", None
        started = time.perf_counter()
        self._last_log_step, self._last_log_time = state.step, started
        try:
            self.bus.emit(RunStarted(
                step=state.step, run_dir=str(self.ctx.run_dir or ""), total_steps=s.max_steps,
                grad_accum=s.grad_accum, experts=tuple(self.adapter.experts), log_every=s.log_every,
            ))
            batches = iter(self.batches)
            active: object = _NO_EXPERT
            while state.step < s.max_steps and not control.stop_requested:
                step = state.step + 1
                expert = self.adapter.expert_for_step(step)
                if expert != active:
                    self.adapter.activate(expert, self.optimizer)
                    if active is not _NO_EXPERT:
                        self.bus.emit(ExpertSwitched(step=step, previous=active, expert=expert))  # type: ignore[arg-type]
                    active = state.expert = expert
                is_log_step = step % s.log_every == 0 or step == s.max_steps

                complete = self._accumulate(step, expert, is_log_step, batches)
                if not complete and control.stop_requested and state.consecutive_oom == 0:
                    self.optimizer.zero_grad(set_to_none=True)
                    break  # stopped mid-accumulation: the partial step is dropped, not applied
                skip_reason = None if complete else "out of memory"
                if complete:
                    self.bus.emit(GradsReady(step=step, is_log_step=is_log_step, expert=expert))
                    skip_reason = control.take_skip_request()
                lrs = self._optimizer_step(skip_reason)
                state.step = step
                if skip_reason is not None:
                    state.skipped_steps += 1
                self.bus.emit(OptimizerStepped(
                    step=step, expert=expert, skipped=skip_reason is not None, skip_reason=skip_reason,
                    lrs=lrs, group_names=self._group_names, is_log_step=is_log_step,
                ))
                if is_log_step:
                    self._log(step, expert, lrs, started)
                save_reason = control.take_save_request()
                if save_reason is None and s.save_every and step % s.save_every == 0 and step < s.max_steps:
                    save_reason = f"every {s.save_every} steps"
                if save_reason is not None:
                    self._save(step, final=False, reason=save_reason)
            if control.stop_requested:
                status, reason = "stopped", control.stop_reason
                if state.consecutive_oom >= s.max_consecutive_oom:
                    status = "failed"
            if status != "failed":
                self._save(state.step, final=True, reason=status)
        except CriticalObserverError as exc:
            status, reason = "failed", str(exc)
            raise
        except BaseException as exc:
            status, reason = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                self.bus.emit(RunEnded(step=state.step, status=status, reason=reason))  # type: ignore[arg-type]
            finally:
                self.bus.close()
                self.ctx.live.clear()
        return RunResult(status=status, reason=reason, steps=state.step, saved=tuple(self._saved))

    def _accumulate(self, step: int, expert: str | None, is_log_step: bool, batches: Iterator[Any]) -> bool:
        """Forward and backward for each micro-step of optimizer step ``step``. False if the step must not be
        applied (a stop request or an out-of-memory error)."""
        state, control, s, live = self.state, self.ctx.control, self.settings, self.ctx.live
        for index in range(1, s.grad_accum + 1):
            state.micro_step += 1
            ends = index == s.grad_accum
            common = dict(step=step, micro_step=state.micro_step, accumulation_index=index,
                          ends_optimizer_step=ends, is_log_step=is_log_step, expert=expert)
            self.bus.emit(StepStarted(**common))
            phase = "forward"
            try:
                batch = next(batches)
                loss = self.adapter.loss(batch, expert, self.generator)
                live.loss, live.batch = loss.detach(), batch
                self.bus.emit(LossComputed(**common))
                self._track_loss(live.loss, expert)
                phase = "backward"
                (loss / s.grad_accum).backward()
                del loss, batch
                state.consecutive_oom = 0
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._out_of_memory(step, expert, phase, exc)
                return False
            finally:
                live.clear()
            if control.stop_requested and not ends:
                return False  # between micro-steps: drop the partial accumulation
        return True

    def _optimizer_step(self, skip_reason: str | None) -> tuple[float, ...]:
        """Clip, apply LR requests, step (unless skipped), zero grads, restore the scheduled LRs, step the scheduler.
        Returns the LRs used."""
        requests = self.ctx.control.take_lr_requests()
        scheduled: dict[int, float] = {}  # group index -> its LR before the one-step override
        for index, (group, name) in enumerate(zip(self.optimizer.param_groups, self._group_names, strict=True)):
            if name in requests:
                scheduled[index] = group["lr"]
                group["lr"] = requests[name]
        lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
        if skip_reason is None:
            if self.settings.clip_grad_norm is not None:
                params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, self.settings.clip_grad_norm, foreach=True)
            try:
                self.optimizer.step()
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._out_of_memory(self.state.step + 1, self.state.expert, "optimizer", exc)
        self.optimizer.zero_grad(set_to_none=True)
        for index, lr in scheduled.items():
            # before scheduler.step(): chainable schedulers (ExponentialLR, StepLR) compute the next LR from this one
            self.optimizer.param_groups[index]["lr"] = lr
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # a skipped step still advances the schedule (it is a function of the step count)
                warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)` before `optimizer\.step")
                self.scheduler.step()
        return lrs

    def _out_of_memory(self, step: int, expert: str | None, phase: str, exc: BaseException) -> None:
        state, s = self.state, self.settings
        self.optimizer.zero_grad(set_to_none=True)
        self.ctx.live.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        state.consecutive_oom += 1
        self.bus.emit(OutOfMemory(
            step=step, micro_step=state.micro_step, expert=expert, phase=phase,
            consecutive=state.consecutive_oom, message=str(exc).splitlines()[0][:300] if str(exc) else "",
        ))
        if state.consecutive_oom >= s.max_consecutive_oom:
            self.ctx.control.request_stop(
                f"out of memory {state.consecutive_oom} times in a row (train.max_consecutive_oom = "
                f"{s.max_consecutive_oom}); lower the resolution, frames or batch size, or enable memory options"
            )

    # -- host values, once per log interval --------------------------------------------------------------------
    def _track_loss(self, loss: torch.Tensor, expert: str | None) -> None:
        metrics = self.ctx.metrics
        metrics.accumulate("train/loss", loss)  # device-side running sum: no sync here
        if expert is not None:
            metrics.accumulate(f"train/loss/{expert}", loss)

    def _log(self, step: int, expert: str | None, lrs: tuple[float, ...], started: float) -> None:
        metrics = self.ctx.metrics
        metrics.put("train/lr", lrs[0])
        if len(lrs) > 1 or self._group_names[0] != "0":
            for name, lr in zip(self._group_names, lrs, strict=True):
                metrics.put(f"train/lr/{name}", lr)
        metrics.put("train/skipped_steps", float(self.state.skipped_steps))
        values = metrics.gather()  # the one device->host transfer of this log interval
        # Timed after the sync above, so queued device work is included: the mean over the interval is honest.
        now = time.perf_counter()
        steps = step - self._last_log_step
        if steps > 0:
            values["train/step_time_s"] = (now - self._last_log_time) / steps
        self._last_log_step, self._last_log_time = step, now
        self.bus.emit(MetricsLogged(
            step=step, expert=expert, values=values, elapsed_s=time.perf_counter() - started,
            total_steps=self.settings.max_steps,
        ))

    def _save(self, step: int, *, final: bool, reason: str) -> None:
        paths = tuple(str(p) for p in self.saver.save(step, final))
        self._saved.extend(paths)
        if paths:
            self.bus.emit(CheckpointSaved(step=step, paths=paths, final=final, reason=reason))


class _NoExpert:
    def __repr__(self) -> str:
        return "<no expert yet>"


_NO_EXPERT = _NoExpert()
