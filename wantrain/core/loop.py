"""The training loop. Read ``Trainer.run`` top to bottom; ``wantrain.core.events`` has the same loop as
pseudocode with every event in place.

Every feature lives elsewhere: logging, metrics, LR finding and alpha control are observers, LoRA files are the
saver's, the checkpoint format is ``core.checkpoint``'s. The loop only emits events, reads the control object at
fixed points, guards against out-of-memory errors and non-finite steps, and gathers host values once per log
interval.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from wantrain.core.adapter import ModelAdapter, NullSaver, Saver
from wantrain.core.bus import Bus
from wantrain.core.checkpoint import CheckpointWriteError, disk_error_line, prune, write_checkpoint
from wantrain.core.context import Context, DeviceMetrics, Live
from wantrain.core.control import Control
from wantrain.core.distributed import SingleProcess
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
from wantrain.core.interval import LogInterval
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
    max_consecutive_nan: int = 5

    @classmethod
    def from_config(cls, train: Any) -> LoopSettings:
        return cls(**{f.name: getattr(train, f.name) for f in attrs.fields(cls) if hasattr(train, f.name)})


@attrs.define
class CheckpointPolicy:
    """Where and when the core writes checkpoints (``core.checkpoint``), besides every LoRA save.

    ``every``: also write one every N optimizer steps (None: only with LoRA saves, at a stop and at the end).
    ``keep_last`` / ``keep_every``: retention (None keeps all). ``meta`` is stored in each checkpoint (the
    assembly puts the config and its hash there).
    """

    directory: Path
    every: int | None = None
    keep_last: int | None = 2
    keep_every: int | None = None
    meta: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class RunResult:
    status: str
    reason: str | None
    steps: int
    saved: tuple[str, ...]


class _StopMicroSteps(Exception):
    """Internal: the micro-step loop ended early (stop request or out of memory)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA/MPS out-of-memory errors and the CPU allocator's "can't allocate memory"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Trainer:
    """Runs optimizer steps ``state.step+1 .. settings.max_steps`` over ``batches`` and emits events on ``bus``.

    The trainer is handed ready-made parts (``wantrain.app.assemble`` assembles them from the config): a
    :class:`ModelAdapter`, an iterable of batches (infinite, or at least long enough; with ``state_dict()`` /
    ``load_state_dict()`` its position is checkpointed), an optimizer over ``adapter.param_groups()``, a scheduler
    with ``step()`` (called once per optimizer step), a :class:`Saver` and an optional :class:`CheckpointPolicy`.
    ``sync`` links the ranks of a torchrun launch (``core.distributed``; one process: nothing is exchanged); on
    ranks other than 0 the saver is a ``NullSaver`` and checkpoints are handed to rank 0, which writes them.

    :meth:`state_dict` / :meth:`load_state_dict` capture and restore everything needed to continue bitwise;
    ``core.checkpoint`` writes that tree to disk.
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
        checkpoints: CheckpointPolicy | None = None,
        sync: Any = None,
    ) -> None:
        self.adapter = adapter
        self.batches = batches
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.saver = saver or NullSaver()
        self.settings = settings
        self.checkpoints = checkpoints
        self.sync = sync if sync is not None else SingleProcess()
        self.state = state or TrainState()
        self.state.total_steps = settings.max_steps
        self.ctx = Context(
            control=Control(), state=self.state, metrics=DeviceMetrics(), live=Live(), run_dir=run_dir,
            config=config, adapter=adapter, optimizer=optimizer, scheduler=scheduler,
        )
        self.bus = bus if bus is not None else Bus()
        self.bus.ctx = self.ctx
        self.generator = torch.Generator(device=adapter.device).manual_seed(seed)
        self.ctx.generator = self.generator
        self._group_names = tuple(g.get("name", str(i)) for i, g in enumerate(optimizer.param_groups))
        self.ctx.control.group_names = self._group_names
        self._saved: list[str] = []
        self._resumed_from: str | None = None
        # The interval's losses and the non-finite guard's per-step flags: device tensors, read at log steps only
        self._interval = LogInterval(adapter.device, settings.log_every)
        self._step_losses: list[torch.Tensor] = []  # the current optimizer step's micro-step losses
        self._agreed_flag: torch.Tensor | None = None  # torchrun: the ranks' verdict on their losses
        self._expert_params: dict[str | None, list[torch.Tensor]] = {}  # torchrun: what average_gradients takes
        # Fused optimizers skip a step on the device when handed ``found_inf`` (the GradScaler protocol): no sync. On
        # the CPU reading the flag costs nothing (no queue to wait for), and found_inf would cost more than it saves
        # (the fused kernel then corrects every parameter's step count with one CPU op per tensor): read it there.
        self._device_skip = (bool(getattr(optimizer, "_step_supports_amp_scaling", False))
                             and torch.device(adapter.device).type != "cpu")

    @property
    def control(self) -> Control:
        return self.ctx.control

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        state, control, s = self.state, self.ctx.control, self.settings
        status, reason = "completed", None
        started = time.perf_counter()
        self._last_log_step, self._last_log_time, self._last_lrs = state.step, started, None
        self._failure: str | None = None
        try:
            self.bus.emit(RunStarted(
                step=state.step, run_dir=str(self.ctx.run_dir or ""), total_steps=s.max_steps,
                grad_accum=s.grad_accum, experts=tuple(self.adapter.experts), log_every=s.log_every,
                resumed_from=self._resumed_from,
            ))
            batches = iter(self.batches)
            self._optimizer_mode("train")
            active: object = _NO_EXPERT
            while state.step < s.max_steps and not self.sync.should_stop(control):
                step = state.step + 1
                expert = self.adapter.expert_for_step(step)
                if expert != active:
                    self.adapter.activate(expert, self.optimizer)
                    self._expert_params.clear()  # a move may replace Parameters (to `meta`, for instance)
                    if active is not _NO_EXPERT:
                        self.bus.emit(ExpertSwitched(step=step, previous=active, expert=expert))  # type: ignore[arg-type]
                    active = state.expert = expert
                is_log_step = step % s.log_every == 0 or step == s.max_steps

                ended = self._accumulate(step, expert, is_log_step, batches)
                ended = self.sync.agree_step(ended, control)  # a stop or an out-of-memory error on any rank
                if ended == "stopped":
                    self.optimizer.zero_grad(set_to_none=True)
                    break  # stopped mid-accumulation: the partial step is dropped, not applied
                skip_reason = ended  # None, or "out of memory"
                params: list[torch.Tensor] = []
                norm = None
                if skip_reason is None:
                    params, norm = self._gradients_ready(expert)
                    if self.bus.wants(GradsReady):  # per-step events are built only when someone listens
                        self.bus.emit(GradsReady(step=step, is_log_step=is_log_step, expert=expert))
                    skip_reason = control.take_skip_request()
                lrs, skip_reason = self._optimizer_step(step, expert, skip_reason, params, norm)
                self.ctx.live.clear()  # the norm: nothing keeps a device tensor alive between steps
                state.step = step
                if skip_reason is not None:
                    state.skipped_steps += 1
                if skip_reason == "out of memory":
                    state.consecutive_oom += 1  # counted per optimizer step: reset only when a step is applied
                elif skip_reason is None:
                    state.consecutive_oom = 0
                self._last_lrs = lrs
                if self.bus.wants(OptimizerStepped):
                    self.bus.emit(OptimizerStepped(
                        step=step, expert=expert, skipped=skip_reason is not None, skip_reason=skip_reason,
                        lrs=lrs, group_names=self._group_names, is_log_step=is_log_step,
                    ))
                if state.consecutive_oom >= s.max_consecutive_oom:
                    self._fail(f"out of memory on {state.consecutive_oom} optimizer steps in a row "
                               f"(train.max_consecutive_oom = {s.max_consecutive_oom}); lower the resolution, "
                               "frames or batch size, or enable memory options")
                    self._save(step, final=False, reason="emergency: out of memory", lora=False)
                    break
                if is_log_step:
                    self._log(step, expert, lrs, started)
                    if self._failure is not None:
                        break  # the non-finite guard tripped: keep the last good checkpoint, save nothing
                self.sync.agree_requests(control)  # a stop or save request on any rank reaches every rank
                save_reason = control.take_save_request()
                if save_reason is None and s.save_every and step % s.save_every == 0 and step < s.max_steps:
                    save_reason = f"every {s.save_every} steps"
                if save_reason is not None:
                    self._save(step, final=False, reason=save_reason)
                elif self._checkpoint_due(step):
                    self._save(step, final=False, reason=f"checkpoint every {self.checkpoints.every} steps",
                               lora=False)
            if state.step > self._last_log_step and self._last_lrs is not None:
                self._log(state.step, state.expert, self._last_lrs, started)  # the partial interval of a stop
            if self._failure is not None:
                status, reason = "failed", self._failure
            elif control.stop_requested:
                status, reason = "stopped", control.stop_reason
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

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        self.ctx.control.request_stop(reason)

    def _accumulate(self, step: int, expert: str | None, is_log_step: bool, batches: Iterator[Any]) -> str | None:
        """Forward and backward for each micro-step of optimizer step ``step``. Returns None when the step may be
        applied, ``"stopped"`` (a stop request between micro-steps) or ``"out of memory"``."""
        state, control, s, live, bus = self.state, self.ctx.control, self.settings, self.ctx.live, self.bus
        self._step_losses = []
        started, computed = bus.wants(StepStarted), bus.wants(LossComputed)
        for index in range(1, s.grad_accum + 1):
            state.micro_step += 1
            ends = index == s.grad_accum
            if started or computed:
                common = dict(step=step, micro_step=state.micro_step, accumulation_index=index,
                              ends_optimizer_step=ends, is_log_step=is_log_step, expert=expert)
            if started:
                bus.emit(StepStarted(**common))
            pinned = control.take_generator_state()
            if pinned is not None:
                self.generator.set_state(pinned)  # an observer asked for these draws (control.set_generator_state)
            phase = "forward"
            try:
                batch = next(batches)
                loss = self.adapter.loss(batch, expert, self.generator)
                live.loss, live.batch = loss.detach(), batch
                if computed:
                    bus.emit(LossComputed(**common))
                self._step_losses.append(live.loss)
                self._interval.add_loss(live.loss, expert)
                phase = "backward"
                (loss / s.grad_accum if s.grad_accum > 1 else loss).backward()
                del loss, batch
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._out_of_memory(step, expert, phase, exc)
                return "out of memory"
            finally:
                live.clear()
            if control.stop_requested and not ends:
                return "stopped"  # between micro-steps: drop the partial accumulation
        return None

    def _gradients_ready(self, expert: str | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Before ``GradsReady``: average the gradients over the ranks (torchrun), then their global norm before
        clipping, which observers read as ``ctx.live.grad_norm`` (device ops only, no sync)."""
        self._agreed_flag = None
        if self.sync.exchanges_gradients:
            expert_params = self._expert_params.get(expert)
            if expert_params is None:  # listed once per switch: walking a 14B transformer's modules costs ms
                expert_params = self._expert_params[expert] = list(self.adapter.trainable_parameters(expert))
            # every rank must skip alike: the non-finite check of each rank's losses travels with the gradients
            self._agreed_flag = torch.zeros((), device=self._interval.device)
            self._interval.check_finite(self._step_losses, self._agreed_flag)
            self._step_losses = []
            self.sync.average_gradients(expert_params, self._agreed_flag)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        self.ctx.live.grad_norm = norm
        return params, norm

    def _optimizer_step(self, step: int, expert: str | None, skip_reason: str | None,
                        params: list[torch.Tensor], norm: torch.Tensor | None
                        ) -> tuple[tuple[float, ...], str | None]:
        """Apply LR requests, clip, step (unless skipped or non-finite), zero grads, restore the scheduled LRs, step
        the scheduler. Returns the LRs used and the skip reason (an out-of-memory error inside ``optimizer.step()``
        skips the step)."""
        requests = self.ctx.control.take_lr_requests()
        scheduled: dict[int, float] = {}  # group index -> its LR before the one-step override
        if requests:
            for index, (group, name) in enumerate(zip(self.optimizer.param_groups, self._group_names, strict=True)):
                if name in requests:
                    scheduled[index] = group["lr"]
                    group["lr"] = requests[name]
        lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
        if skip_reason is None and norm is not None:
            if self.settings.clip_grad_norm is not None:  # the same arithmetic as clip_grad_norm_
                torch.nn.utils.clip_grads_with_norm_(params, self.settings.clip_grad_norm, norm, foreach=True)
            # the non-finite guard: one fused check of the step's losses and the norm into the step's flag
            flag = self._interval.next_flag()
            if self._agreed_flag is not None:
                flag.copy_(self._agreed_flag)
            self._interval.check_finite([*self._step_losses, norm], flag)
            try:
                if self._device_skip:
                    # the fused kernel skips parameters, moments and its step count when found_inf is 1: no sync
                    self.optimizer.found_inf = flag  # type: ignore[attr-defined]
                    try:
                        self.optimizer.step()
                    finally:
                        self.optimizer.found_inf = None  # type: ignore[attr-defined]
                elif not flag.item():  # a device->host sync per step: CPU runs, optimizers without found_inf
                    self.optimizer.step()
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._out_of_memory(step, expert, "optimizer", exc)
                skip_reason = "out of memory"
        self.optimizer.zero_grad(set_to_none=True)
        for index, lr in scheduled.items():
            # before scheduler.step(): chainable schedulers (ExponentialLR, StepLR) compute the next LR from this one
            self.optimizer.param_groups[index]["lr"] = lr
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # a skipped step still advances the schedule (it is a function of the step count)
                warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)` before `optimizer\.step")
                self.scheduler.step()
        self._step_losses = []
        return lrs, skip_reason

    def _out_of_memory(self, step: int, expert: str | None, phase: str, exc: BaseException) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.ctx.live.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.bus.emit(OutOfMemory(
            step=step, micro_step=self.state.micro_step, expert=expert, phase=phase,
            consecutive=self.state.consecutive_oom + 1,
            message=str(exc).splitlines()[0][:300] if str(exc) else "",
        ))

    # -- host values, once per log interval --------------------------------------------------------------------
    def _log(self, step: int, expert: str | None, lrs: tuple[float, ...], started: float) -> None:
        metrics, s = self.ctx.metrics, self.settings
        metrics.put("train/lr", lrs[0])
        if len(lrs) > 1 or self._group_names[0] != "0":
            for name, lr in zip(self._group_names, lrs, strict=True):
                metrics.put(f"train/lr/{name}", lr)
        # the one device->host transfer of this log interval: the observers' values, the losses, the guard's flags
        values, interval = metrics.gather_with(self._interval.device_parts())
        values.update(self._interval.close(interval))
        values = self.sync.reduce_metrics(values)  # torchrun: rank 0's reduction over the ranks, on every rank
        values["train/skipped_steps"] = float(self.state.skipped_steps) + values["train/nan_skipped_steps"]
        # Timed after the sync above, so queued device work is included: the mean over the interval is honest.
        now = time.perf_counter()
        steps = step - self._last_log_step
        if steps > 0:
            values["train/step_time_s"] = (now - self._last_log_time) / steps
        self._last_log_step, self._last_log_time = step, now
        self.bus.emit(MetricsLogged(
            step=step, expert=expert, values=values, elapsed_s=time.perf_counter() - started,
            total_steps=s.max_steps,
        ))
        # The guard decides from the logged host value, so replaying the event log reproduces the decision.
        if values["train/nan_streak_max"] >= s.max_consecutive_nan:
            self._fail(f"non-finite loss or gradients on {int(values['train/nan_streak_max'])} optimizer steps in "
                       f"a row (train.max_consecutive_nan = {s.max_consecutive_nan}); those steps were skipped. "
                       "Lower the learning rate or check the data; the last good checkpoint is kept")

    # -- saving ------------------------------------------------------------------------------------------------
    def _checkpoint_due(self, step: int) -> bool:
        c = self.checkpoints
        return c is not None and bool(c.every) and step % c.every == 0 and step < self.settings.max_steps

    def _optimizer_mode(self, mode: str) -> None:
        """Optimizers with ``train()``/``eval()`` modes (schedule-free ones) hold the training iterate in the
        parameters in train mode and the weights to use in eval mode: steps run in train mode, LoRA files and
        checkpoints are written in eval mode. Other optimizers have no such methods: nothing happens."""
        switch = getattr(self.optimizer, mode, None)
        if callable(switch):
            switch()

    def _save(self, step: int, *, final: bool, reason: str, lora: bool = True) -> None:
        # Eval mode while saving; after the final save it stays (the in-memory weights are the saved ones). Every
        # save switches the same way, so a run resumed from a checkpoint repeats the uninterrupted run's arithmetic.
        self._optimizer_mode("eval")
        try:
            self._write(step, final=final, reason=reason, lora=lora)
        finally:
            if not final:
                self._optimizer_mode("train")

    def _write(self, step: int, *, final: bool, reason: str, lora: bool) -> None:
        paths: tuple[str, ...] = ()
        if lora:
            try:
                paths = tuple(str(p) for p in self.saver.save(step, final))
            except OSError as exc:
                where = Path(exc.filename) if getattr(exc, "filename", None) else Path(self.ctx.run_dir or ".")
                raise CheckpointWriteError(disk_error_line("LoRA file", where, exc)) from exc
            self._saved.extend(paths)
        checkpoint = None
        tree = self.sync.gather_state(self.state_dict()) if self.checkpoints is not None else None
        if tree is not None:  # None on ranks other than 0: rank 0 writes every rank's state
            c = self.checkpoints
            sidecars = [o.write_sidecars for o in self.bus.observers if callable(getattr(o, "write_sidecars", None))]
            checkpoint = write_checkpoint(c.directory, step, tree, meta={**c.meta, "reason": reason},
                                          sidecars=sidecars)
            prune(c.directory, keep_last=c.keep_last, keep_every=c.keep_every, protect=(step,))
        if paths or checkpoint is not None:
            self.bus.emit(CheckpointSaved(step=step, paths=paths, final=final, reason=reason,
                                          checkpoint=str(checkpoint) if checkpoint is not None else None))

    # -- state: everything needed to continue bitwise ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state as a tree of tensors and JSON values (live references: ``core.checkpoint`` copies)."""
        adapter = self.adapter
        if callable(getattr(adapter, "state_dict", None)):
            model = adapter.state_dict()
        else:
            model = {f"{e}/{i}": p for e in adapter.experts for i, p in enumerate(adapter.trainable_parameters(e))}
        observers = {}
        for name, obs in _stateful_observers(self.bus.observers):
            observers[name] = obs.state_dict()
        return {
            "train_state": attrs.asdict(self.state),
            "generator": self.generator.get_state(),
            "rng": capture_rng(),
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "data": self.batches.state_dict() if callable(getattr(self.batches, "state_dict", None)) else None,
            "metrics": self.ctx.metrics.state_dict(),
            "interval": self._interval.state_dict(),
            "observers": observers,
        }

    def load_state_dict(self, tree: Mapping[str, Any], *, source: str | None = None) -> list[str]:
        """Restore :meth:`state_dict` output before :meth:`run`. The optimizer's hyperparameters (LR, betas, ...)
        stay those of the current config, except group keys the optimizer names in ``group_state_keys``;
        everything else is the saved state. Returns warnings (observers whose
        state was saved but that are not attached now, or attached but without saved state)."""
        for f in attrs.fields(TrainState):
            if f.name != "total_steps" and f.name in tree["train_state"]:
                setattr(self.state, f.name, tree["train_state"][f.name])
        self.generator.set_state(tree["generator"].to(torch.uint8))
        adapter = self.adapter
        if callable(getattr(adapter, "load_state_dict", None)):
            adapter.load_state_dict(tree["model"])
        else:
            with torch.no_grad():
                for e in adapter.experts:
                    for i, p in enumerate(adapter.trainable_parameters(e)):
                        p.copy_(tree["model"][f"{e}/{i}"])
        # Group keys an optimizer names in ``group_state_keys`` are its state (Prodigy's d, schedule-free's k), not
        # hyperparameters: they keep their saved values.
        evolving = {"params", *getattr(self.optimizer, "group_state_keys", ())}
        fresh = [{k: v for k, v in g.items() if k not in evolving} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(tree["optimizer"])
        for group, hyper in zip(self.optimizer.param_groups, fresh, strict=True):
            group.update(hyper)  # the config's hyperparameters win (a changed LR is allowed on resume)
        if self.scheduler is not None and tree.get("scheduler") is not None:
            self.scheduler.load_state_dict(tree["scheduler"])
            if callable(getattr(self.scheduler, "get_last_lr", None)):
                # torch's schedulers restore their counters but not the groups' LR: put back the saved step's LR
                for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                    group["lr"] = lr
        if tree.get("data") is not None and callable(getattr(self.batches, "load_state_dict", None)):
            self.batches.load_state_dict(tree["data"])
        metric_state = {"sums": dict(tree["metrics"].get("sums", {}))}
        if "interval" in tree:
            self._interval.load_state_dict(tree["interval"])
        else:  # written before core.interval existed: device-side guard counters, loss sums in the metrics
            self._interval.load_legacy(tree["nonfinite_guard"], metric_state["sums"])
        self.ctx.metrics.load_state_dict(metric_state)
        warnings_out = []
        saved = dict(tree.get("observers", {}))
        for name, obs in _stateful_observers(self.bus.observers):
            if name in saved:
                obs.load_state_dict(saved.pop(name))
            else:
                warnings_out.append(f"observer {name} has no state in the checkpoint; it starts fresh")
        warnings_out += [f"the checkpoint holds state of observer {name}, which is not attached; ignored"
                         for name in saved]
        restore_rng(tree["rng"])
        self._resumed_from = source
        return warnings_out


def _stateful_observers(observers: Iterable[Any]) -> list[tuple[str, Any]]:
    """(unique name, observer) of every observer with ``state_dict``/``load_state_dict``, in attachment order;
    a second observer of the same name is keyed ``name#2``."""
    out, seen = [], {}
    for obs in observers:
        if callable(getattr(obs, "state_dict", None)) and callable(getattr(obs, "load_state_dict", None)):
            name = getattr(obs, "name", type(obs).__name__)
            seen[name] = seen.get(name, 0) + 1
            out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", obs))
    return out


def capture_rng() -> dict[str, Any]:
    """Python's, numpy's and torch's global random states (CUDA's when it is in use)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(rng: Mapping[str, Any]) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = rng["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(rng["torch"].to(torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in rng["cuda"]])


class _NoExpert:
    def __repr__(self) -> str:
        return "<no expert yet>"


_NO_EXPERT = _NoExpert()
