"""The training loop. Read ``Trainer.run`` top to bottom; ``wantrain.core.events`` has the same loop as
pseudocode with every event in place.

Every feature lives elsewhere: logging, metrics, LR finding and alpha control are observers, LoRA files are the
saver's, the checkpoint format is ``core.checkpoint``'s. The loop only emits events, reads the control object at
fixed points, guards against out-of-memory errors and non-finite steps, and gathers host values once per log
interval.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from wantrain.core.adapter import ModelAdapter, NullSaver, Saver, check_needs, evaluation_session
from wantrain.core.atomic import is_storage_error
from wantrain.core.bus import Bus
from wantrain.core.checkpoint import (
    latest_complete,
    mark_announced,
    prune,
    save_error,
    was_announced,
    write_checkpoint,
)
from wantrain.core.context import Context, DeviceMetrics, Live
from wantrain.core.control import Control
from wantrain.core.errors import CriticalObserverError
from wantrain.core.events import (
    BatchDrawn,
    CheckpointSaved,
    ControlRequested,
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
from wantrain.core.inbox import Inbox
from wantrain.core.interval import LORA_NORM, LORA_NORM_START, LogInterval
from wantrain.core.parallel.distributed import SingleProcess
from wantrain.core.parallel.sharding import is_sharded, whole
from wantrain.core.state import RunParts, TrainState, capture, restore


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
    divergence_factor: float | None = None  # core.interval.DivergenceGuard; None: off

    @classmethod
    def from_config(cls, train: Any) -> LoopSettings:
        return cls(**{f.name: getattr(train, f.name) for f in attrs.fields(cls) if hasattr(train, f.name)})


@attrs.define
class CheckpointPolicy:
    """Where and when the core writes checkpoints (``core.checkpoint``), besides every LoRA save.

    ``every``: also write one every N optimizer steps (None: only with LoRA saves, at a stop and at the end).
    ``keep_last`` / ``keep_every``: retention (None keeps all). ``meta`` is stored in each checkpoint (the
    assembly puts the config and its hash there; the core adds the save's reason, LoRA paths and ``final``, from
    which a resumed run delivers a ``CheckpointSaved`` a kill cut off). ``write`` has the signature of
    ``core.checkpoint.write_checkpoint`` (``[faults]`` wraps it).
    """

    directory: Path
    every: int | None = None
    keep_last: int | None = 2
    keep_every: int | None = None
    meta: dict[str, Any] = attrs.field(factory=dict)
    write: Any = write_checkpoint


@attrs.frozen
class RunResult:
    status: str
    reason: str | None
    steps: int
    saved: tuple[str, ...]


# cuBLAS / cuDNN failing to allocate their workspace: an out-of-memory error that reaches Python as a RuntimeError
_ALLOC_FAILED = ("cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA/MPS out-of-memory errors, cuBLAS/cuDNN allocation failures and the CPU allocator's "can't
    allocate memory"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                              or any(code in text for code in _ALLOC_FAILED))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else ""


class Trainer:
    """Runs optimizer steps ``state.step+1 .. settings.max_steps`` over ``batches`` and emits events on ``bus``.

    The trainer is handed ready-made parts (``wantrain.app.assemble`` assembles them from the config): a
    :class:`ModelAdapter`, an iterable of batches (infinite, or at least long enough; with ``state_dict()`` /
    ``load_state_dict()`` its position is checkpointed), an optimizer over ``adapter.param_groups()``, a scheduler
    with ``step()`` (called once per optimizer step), a :class:`Saver` and an optional :class:`CheckpointPolicy`.
    ``sync`` links the ranks of a torchrun launch (``core.parallel.distributed``; one process: nothing is exchanged); on
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
            adapter=adapter, optimizer=optimizer, scheduler=scheduler,
        )
        self.bus = bus if bus is not None else Bus()
        for observer in self.bus.observers:  # attached before the trainer: their capabilities are checked now
            check_needs(observer, adapter)
        self.bus.ctx = self.ctx
        self.generator = torch.Generator(device=adapter.device).manual_seed(seed)
        self.ctx.generator = self.generator
        self._group_names = tuple(g.get("name", str(i)) for i, g in enumerate(optimizer.param_groups))
        self.ctx.control.group_names = self._group_names
        self.ctx.control.bind_evaluation(
            lambda: evaluation_session(adapter, optimizer, moved=self._expert_params.clear))  # type: ignore[arg-type]
        self._active: object = _NO_EXPERT  # the expert on the training device, as the loop activated it
        self._saved: list[str] = []
        self._saved_at: dict[int, set[str]] = {}  # what was saved at a step ("lora", "checkpoint"): a stop saves once
        self._resumed_from: str | None = None
        self._undelivered: CheckpointSaved | None = None  # see load_state_dict
        self._norm_at_start: torch.Tensor | None = None  # the divergence guard's norm baseline, until logged
        # The interval's losses and the non-finite guard's per-step flags: device tensors, read at log steps only
        self._interval = LogInterval(adapter.device, settings.log_every, settings.divergence_factor)
        self._step_losses: list[torch.Tensor] = []  # the current optimizer step's micro-step losses
        self._agreed_flag: torch.Tensor | None = None  # torchrun: the ranks' verdict on their losses
        self._expert_params: dict[str | None, list[torch.Tensor]] = {}  # torchrun: what average_gradients takes
        # a person's requests (core.inbox), read by rank 0: a clock read per step, a stat every 0.2 s
        self._inbox = Inbox(run_dir) if run_dir is not None and self.sync.is_main else None
        # Fused optimizers skip a step on the device when handed ``found_inf`` (the GradScaler protocol): no sync. On
        # the CPU reading the flag costs nothing (no queue to wait for), and found_inf would cost more than it saves
        # (the fused kernel then corrects every parameter's step count with one CPU op per tensor): read it there.
        self._device_skip = (bool(getattr(optimizer, "_step_supports_amp_scaling", False))
                             and torch.device(adapter.device).type != "cpu")
        self._parts = RunParts(state=self.state, generator=self.generator, adapter=adapter, optimizer=optimizer,
                               scheduler=scheduler, batches=batches, metrics=self.ctx.metrics,
                               interval=self._interval, bus=self.bus)

    @property
    def control(self) -> Control:
        return self.ctx.control

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        state, control, s = self.state, self.ctx.control, self.settings
        status, reason = "completed", None
        self._started = time.perf_counter()
        self._last_log_step, self._last_log_time, self._last_lrs = state.step, self._started, None
        self._failure: str | None = None
        try:
            self.bus.emit(RunStarted(
                step=state.step, run_dir=str(self.ctx.run_dir or ""), total_steps=s.max_steps,
                grad_accum=s.grad_accum, log_every=s.log_every,
                # the run's experts: this process's, or every expert group's (core.parallel.expert_groups)
                experts=tuple(getattr(self.sync, "experts", None) or self.adapter.experts),
                resumed_from=self._resumed_from,
            ))
            if self._undelivered is not None:  # resumed from a checkpoint whose CheckpointSaved a kill cut off
                self.bus.emit(self._undelivered)
                mark_announced(Path(self._undelivered.checkpoint))  # type: ignore[arg-type]
            divergence = self._interval.divergence
            if divergence.factor is not None and LORA_NORM not in divergence.baseline:  # a fresh run: no sync
                self._norm_at_start = self._lora_norm()
            batches = iter(self.batches)
            self._optimizer_mode("train")
            while state.step < s.max_steps and not self.sync.should_stop(control):
                step = state.step + 1
                expert = self._switch_expert(step)
                is_log_step = step % s.log_every == 0 or step == s.max_steps

                # torchrun: every rank draws from the same stream (the global batch's draws, each rank its rows),
                # so a step that ends early on one rank alone (out of memory, a stop between micro-steps) rewinds
                # the stream on every rank: none drew more than another (a host copy of the state, no sync)
                draws = self.generator.get_state() if self.sync.exchanges_gradients else None
                ended = self._accumulate(step, expert, is_log_step, batches)
                ended = self.sync.agree_step(ended, control, step)  # a stop or an out-of-memory error on any rank
                if ended is not None and draws is not None:
                    self.generator.set_state(draws)
                    for _ in range(s.grad_accum - self._drawn):  # every rank passes the step's batches alike
                        next(batches)
                if ended == "stopped":
                    self.optimizer.zero_grad(set_to_none=True)
                    break  # stopped mid-accumulation: the partial step is dropped, not applied
                self._step(step, expert, is_log_step, ended)  # ended: None, or "out of memory" (the step is skipped)
                if state.consecutive_oom >= s.max_consecutive_oom:
                    self._save_emergency(step)
                    break
                if is_log_step:
                    self._log(step, expert, self._last_lrs)
                if control.has_model_requests:
                    self._apply_model_requests()
                if self._failure is not None:
                    break  # the non-finite guard tripped: keep the last good checkpoint, save nothing
                if self._inbox is not None:
                    self._read_inbox(step)
                self.sync.agree_requests(control)  # a stop or save request on any rank reaches every rank
                self._save_if_due(step)
            status, reason = self._finish()
        except CriticalObserverError as exc:
            status, reason = "failed", str(exc)
            raise
        except KeyboardInterrupt:
            status, reason = "aborted", "interrupted by a second Ctrl-C"
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

    def _switch_expert(self, step: int) -> str | None:
        """Activate the expert that trains ``step`` when it is not the one on the device, and emit
        ``ExpertSwitched`` when it is not the expert of the previous step (not before a run's first step; a run
        resumed at a boundary switches there as the uninterrupted run did: the previous step's expert is the
        checkpoint's ``state.expert``)."""
        expert = self.adapter.expert_for_step(step)
        if expert != self._active:
            self.adapter.activate(expert, self.optimizer)
            self._expert_params.clear()  # a move may replace Parameters (to `meta`, for instance)
            self._active = expert
        previous = self.state.expert if step > 1 else _NO_EXPERT
        if expert != previous:
            if previous is not _NO_EXPERT:
                self.bus.emit(ExpertSwitched(step=step, previous=previous, expert=expert))  # type: ignore[arg-type]
            self.state.expert = expert
        return expert

    def _step(self, step: int, expert: str | None, is_log_step: bool, skip_reason: str | None) -> None:
        """After the micro-steps: the gradients' norm and ``GradsReady`` (unless the step is already skipped), the
        optimizer step, the step's bookkeeping and ``OptimizerStepped``."""
        params: list[torch.Tensor] = []
        norm = None
        if skip_reason is None:
            params, norm = self._gradients_ready(expert)
            if self.bus.wants(GradsReady):  # per-step events are built only when someone listens
                self.bus.emit(GradsReady(step=step, is_log_step=is_log_step, expert=expert))
            skip_reason = self.ctx.control.take_skip_request()
        lrs, skip_reason = self._optimizer_step(step, expert, skip_reason, params, norm)
        self.ctx.live.clear()  # the norm: nothing keeps a device tensor alive between steps
        self._count_step(step, skip_reason, lrs)
        if self.bus.wants(OptimizerStepped):
            self.bus.emit(OptimizerStepped(
                step=step, expert=expert, skipped=skip_reason is not None, skip_reason=skip_reason,
                lrs=lrs, group_names=self._group_names, is_log_step=is_log_step,
            ))

    def _count_step(self, step: int, skip_reason: str | None, lrs: tuple[float, ...]) -> None:
        state = self.state
        state.step = step
        if skip_reason is not None:
            state.skipped_steps += 1
        if skip_reason == "out of memory":
            state.consecutive_oom += 1  # counted per optimizer step: reset only when a step is applied
        elif skip_reason is None:
            state.consecutive_oom = 0
        self._last_lrs = lrs

    def _apply_model_requests(self) -> None:
        """The control object's model changes (``set_lora_alpha``), in the order asked: after a step's events,
        before its saves."""
        for expert, alpha, preserve_output in self.ctx.control.take_alpha_requests():
            self.adapter.change_lora_alpha(alpha, expert, self.optimizer, preserve_output=preserve_output)

    def _read_inbox(self, step: int) -> None:
        """A person's requests (``core.inbox``): each one is recorded as ``ControlRequested``; save and stop go to
        the control object, sample and validate are the observers' (they act on the event)."""
        control = self.ctx.control
        for request in self._inbox.poll():  # type: ignore[union-attr]
            refused = request.error
            if refused is None and request.action in ("sample", "validate") and self.sync.topology.distributed:
                refused = "not under torchrun: every rank would have to agree on the step"
            self.bus.emit(ControlRequested(step=step, action=request.action, source=request.source,
                                           request_id=request.request_id, refused=refused))
            if refused is None and request.action == "save":
                control.request_save(f"requested ({request.source})")
            elif refused is None and request.action == "stop":
                control.request_stop(f"requested ({request.source})")

    def _finish(self) -> tuple[str, str | None]:
        """After the last step: log a stop's partial interval, apply what it requested, save unless failed."""
        state, control = self.state, self.ctx.control
        if state.step > self._last_log_step and self._last_lrs is not None:
            self._log(state.step, state.expert, self._last_lrs)  # the partial interval of a stop
            if control.has_model_requests:
                self._apply_model_requests()
        if self._failure is not None:
            return "failed", self._failure
        status, reason = ("stopped", control.stop_reason) if control.stop_requested else ("completed", None)
        step, done = state.step, self._saved_at.get(state.step, set())
        wanted = {"lora", "checkpoint"} if self.checkpoints is not None else {"lora"}
        if status == "stopped" and done >= wanted:
            return status, reason  # the stop came during this step's save: it is on disk once, not twice
        self._save(step, final=True, reason=status, checkpoint="checkpoint" not in done or status != "stopped")
        return status, reason

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        self.ctx.control.request_stop(reason)

    def _accumulate(self, step: int, expert: str | None, is_log_step: bool, batches: Iterator[Any]) -> str | None:
        """Forward and backward for each micro-step of optimizer step ``step``. Returns None when the step may be
        applied, ``"stopped"`` (a stop request between micro-steps) or ``"out of memory"``."""
        state, control, s, live, bus = self.state, self.ctx.control, self.settings, self.ctx.live, self.bus
        self._step_losses = []
        started, computed, drawn = bus.wants(StepStarted), bus.wants(LossComputed), bus.wants(BatchDrawn)
        self._drawn = 0  # batches drawn in this step (torchrun: a step ended early passes the rest, in run())
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
            phase, failure = "forward", None
            try:
                batch = next(batches)
                self._drawn += 1
                if drawn and "trained" in batch:  # what the global batch trains, every rank's rows (read only)
                    bus.emit(BatchDrawn(step=step, micro_step=state.micro_step, samples=batch["trained"]))
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
                failure = _first_line(exc)
            finally:
                live.clear()
            if failure is not None:
                # out of the except block, so the error's traceback no longer holds this step's frames; dropping
                # the loss and batch frees the failed graph before the allocator is asked to give memory back
                loss = batch = None  # noqa: F841 -- releasing the references is the point
                self._out_of_memory(step, expert, phase, failure)
                return "out of memory"
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
        norm = whole(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))  # fsdp: a DTensor's
        # partial norms summed over the ranks (a device-side all-reduce, no sync)
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
            for group, name in zip(self.optimizer.param_groups, self._group_names, strict=True):
                leader = group.get("follows")  # a group that keeps a ratio to another's LR (LoRA+'s B matrices)
                if leader in requests and name not in requests:
                    requests[name] = requests[leader] * float(group.get("lr_ratio", 1.0))
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
                self._out_of_memory(step, expert, "optimizer", _first_line(exc))
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

    def _out_of_memory(self, step: int, expert: str | None, phase: str, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.ctx.live.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.bus.emit(OutOfMemory(
            step=step, micro_step=self.state.micro_step, expert=expert, phase=phase,
            consecutive=self.state.consecutive_oom + 1,
            message=message,
        ))

    # -- host values, once per log interval --------------------------------------------------------------------
    def _log(self, step: int, expert: str | None, lrs: tuple[float, ...]) -> None:
        metrics, s = self.ctx.metrics, self.settings
        metrics.put("train/lr", lrs[0])
        if len(lrs) > 1 or self._group_names[0] != "0":
            for name, lr in zip(self._group_names, lrs, strict=True):
                metrics.put(f"train/lr/{name}", lr)
        if self._interval.divergence.factor is not None:
            metrics.put(LORA_NORM, self._lora_norm())  # a device value: it travels with the transfer below
            if self._norm_at_start is not None:
                metrics.put(LORA_NORM_START, self._norm_at_start)
                self._norm_at_start = None
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
            step=step, expert=expert, values=values, elapsed_s=time.perf_counter() - self._started,
            total_steps=s.max_steps,
        ))
        # The guard decides from the logged host value, so replaying the event log reproduces the decision.
        if values["train/nan_streak_max"] >= s.max_consecutive_nan:
            self._fail(f"non-finite loss or gradients on {int(values['train/nan_streak_max'])} optimizer steps in "
                       f"a row (train.max_consecutive_nan = {s.max_consecutive_nan}); those steps were skipped. "
                       f"Lower the learning rate or check the data; {self._what_is_kept()}")
        diverged = self._interval.divergence.check(values)  # from logged host values too: replay reproduces it
        if diverged is not None:
            self._fail(f"the run diverged: {diverged}. Lower the learning rate; {self._what_is_kept()}")

    def _what_is_kept(self) -> str:
        """What a failed run leaves to resume from, read from disk (only on the failure path): the last complete
        checkpoint, or none yet."""
        best = latest_complete(self.checkpoints.directory)[0] if self.checkpoints is not None else None
        if best is None:
            return "no checkpoint was written before it, so there is nothing to resume from: start again"
        return f"the last good checkpoint is kept (step {best.step}; --resume auto continues from it)"

    def _lora_norm(self) -> torch.Tensor:
        """L2 norm of every trainable LoRA tensor, on the training device (log steps only; no sync: a waiting
        expert's tensors on another device are reduced there and their one number copied over). Sharded (fsdp):
        each rank's shards' norms, then one scalar all-reduce, as the gradient norm (not the whole LoRA gathered)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in self.adapter.trainable_parameters():
            by_device.setdefault(p.device, []).append(p.detach())
        squares = []
        for ps in by_device.values():
            if is_sharded(ps[0]):
                square = whole(torch.nn.utils.get_total_norm(ps, foreach=True)).float().square()
            else:
                square = torch.stack(torch._foreach_norm(ps)).float().square().sum()
            squares.append(square.to(self._interval.device))
        return torch.stack(squares).sum().sqrt()

    # -- saving: on request or schedule, the emergency checkpoint, the final save -----------------------------
    def _save_if_due(self, step: int) -> None:
        """A LoRA save (with a checkpoint) on a save request or every ``save_every`` steps; else a checkpoint alone
        every ``checkpoints.every`` steps. Never at the last step: the final save covers it."""
        s, c = self.settings, self.checkpoints
        reason = self.ctx.control.take_save_request()
        if reason is None and s.save_every and step % s.save_every == 0 and step < s.max_steps:
            reason = f"every {s.save_every} steps"
        if reason is not None:
            self._save(step, final=False, reason=reason)
        elif c is not None and c.every and step % c.every == 0 and step < s.max_steps:
            self._save(step, final=False, reason=f"checkpoint every {c.every} steps", lora=False)

    def _save_emergency(self, step: int) -> None:
        """Too many out-of-memory steps in a row: stop, with a checkpoint (no LoRA files) to resume from."""
        oom, limit = self.state.consecutive_oom, self.settings.max_consecutive_oom
        self._fail(f"out of memory on {oom} optimizer steps in a row (train.max_consecutive_oom = {limit}); lower "
                   "the resolution, frames or batch size, or enable memory options")
        self._save(step, final=False, reason="emergency: out of memory", lora=False)

    def _optimizer_mode(self, mode: str) -> None:
        """Optimizers with ``train()``/``eval()`` modes (schedule-free ones) hold the training iterate in the
        parameters in train mode and the weights to use in eval mode: steps run in train mode, LoRA files and
        checkpoints are written in eval mode. Other optimizers have no such methods: nothing happens."""
        switch = getattr(self.optimizer, mode, None)
        if callable(switch):
            switch()

    @property
    def saved(self) -> tuple[str, ...]:
        """The LoRA files this trainer wrote so far (paths, in order)."""
        return tuple(self._saved)

    def _save(self, step: int, *, final: bool, reason: str, lora: bool = True, checkpoint: bool = True) -> None:
        # Eval mode while saving; after the final save it stays (the in-memory weights are the saved ones). Every
        # save switches the same way, so a run resumed from a checkpoint repeats the uninterrupted run's arithmetic.
        self._optimizer_mode("eval")
        try:
            with self.sync.writing():  # a failure on another rank meanwhile waits for it (core.parallel.failures)
                self._write(step, final=final, reason=reason, lora=lora, checkpoint=checkpoint)
        finally:
            if not final:
                self._optimizer_mode("train")

    def _write(self, step: int, *, final: bool, reason: str, lora: bool, checkpoint: bool) -> None:
        paths: tuple[str, ...] = ()
        if lora:
            try:
                paths = tuple(str(p) for p in self.saver.save(step, final))
            except Exception as exc:  # a full disk, no permission (OSError, SafetensorError, StorageError)
                if not is_storage_error(exc) and not isinstance(exc, OSError):
                    raise
                where = getattr(exc, "path", None) or getattr(exc, "filename", None) or self.ctx.run_dir or "."
                raise save_error("LoRA file", Path(where), exc,
                                 checkpoints=self.checkpoints.directory if self.checkpoints else None) from exc
            self._saved.extend(paths)
            self._saved_at.setdefault(step, set()).add("lora")
        written = None
        wants_tree = checkpoint and self.checkpoints is not None
        # fsdp: the LoRA and optimizer state gathered whole to the writing rank only (the others send their streams)
        tree = self.sync.gather_state(capture(self._parts, to_writer=True)) if wants_tree else None
        if tree is not None:  # None on ranks other than 0: rank 0 writes every rank's state
            c = self.checkpoints
            sidecars = [o.write_sidecars for o in self.bus.observers if callable(getattr(o, "write_sidecars", None))]
            meta = {**c.meta, "reason": reason, "lora_paths": list(paths), "final": final}
            written = c.write(c.directory, step, tree, meta=meta, sidecars=sidecars)
            prune(c.directory, keep_last=c.keep_last, keep_every=c.keep_every, protect=(step,))
        if wants_tree:
            self._saved_at.setdefault(step, set()).add("checkpoint")
        if paths or written is not None:
            self.bus.emit(CheckpointSaved(step=step, paths=paths, final=final, reason=reason,
                                          checkpoint=str(written) if written is not None else None))
            if written is not None:
                mark_announced(written)  # delivered: a resume from it does not deliver it again

    # -- state: everything needed to continue bitwise (core.state) ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state as a tree of tensors and JSON values (live references: ``core.checkpoint`` copies)."""
        return capture(self._parts)

    def load_state_dict(self, tree: Mapping[str, Any], *, source: str | None = None,
                        meta: Mapping[str, Any] | None = None) -> list[str]:
        """Restore :meth:`state_dict` output before :meth:`run` (``core.state.restore``); returns its warnings.
        ``source`` is the checkpoint directory and ``meta`` its metadata: when its ``CheckpointSaved`` was never
        delivered (a kill right after the rename), :meth:`run` delivers it right after ``RunStarted``."""
        warnings_out = restore(self._parts, tree)
        self._resumed_from = source
        if source is not None and meta is not None and "lora_paths" in meta and not was_announced(Path(source)):
            self._undelivered = CheckpointSaved(
                step=self.state.step, paths=tuple(meta["lora_paths"]), final=bool(meta.get("final")),
                reason=str(meta.get("reason", "")), checkpoint=str(source))
        return warnings_out


class _NoExpert:
    def __repr__(self) -> str:
        return "<no expert yet>"


_NO_EXPERT = _NoExpert()
