"""A stand-in for the core loop, for observer tests: it emits the events in the order of the pseudocode in
``wantrain.core.events`` through a real ``Bus`` and ``Context`` and gathers ``ctx.metrics`` at log steps, as the
core does. The model is a pair of tiny LoRA-like factors per expert, so norms and losses are real numbers.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from wantrain.core.bus import Bus, Observer, Priority, on
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import (
    Event,
    ExpertSwitched,
    GradsReady,
    LossComputed,
    MetricsLogged,
    ObserverFailed,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepStarted,
)


class LoraAdapter:
    """``trainable_parameters(expert)`` of LoRA factors ``down`` (rank x 8) and ``up`` (8 x rank) per expert."""

    def __init__(self, experts: tuple[str | None, ...] = ("high_noise", "low_noise"), device: str = "cpu",
                 rank: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.experts = experts
        self.device = torch.device(device)
        self.alpha_changes: list[tuple[float, str | None, bool]] = []
        self.params = {
            e: [torch.nn.Parameter((torch.randn(rank, 8, generator=g) * 0.5).to(self.device)),
                torch.nn.Parameter((torch.randn(8, rank, generator=g) * 0.5).to(self.device))]
            for e in experts
        }

    def trainable_parameters(self, expert: str | None = None) -> list[torch.nn.Parameter]:
        if expert is None:
            return [p for e in self.experts for p in self.params[e]]
        return list(self.params[expert])

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": self.params[e], "lr": 0.05, "name": e or "lora"} for e in self.experts]

    def expert_for_step(self, step: int, switch_every: int = 2) -> str | None:
        return self.experts[((step - 1) // switch_every) % len(self.experts)]

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Both experts stay on ``device`` (no offload in this stand-in)."""

    def loss(self, batch: dict[str, torch.Tensor], expert: str | None, generator: torch.Generator | None = None,
             ) -> torch.Tensor:
        down, up = self.params[expert]
        return (batch["x"] @ up @ down - batch["y"]).pow(2).mean()

    def change_lora_alpha(self, alpha: float, expert: str | None, optimizer: torch.optim.Optimizer | None = None,
                          *, preserve_output: bool = True) -> None:
        """Records the change (``core.adapter.AlphaChangeable``; the alpha controller needs it)."""
        self.alpha_changes.append((alpha, expert, preserve_output))


class SyncCounter(TorchFunctionMode):
    """Counts host conversions of tensors (``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``.cpu()``, ...)
    while active, per step: ``counts[step]``. Each of these is a device->host sync on a GPU."""

    CONVERSIONS = frozenset({
        "item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__",
        "__repr__", "__format__", "__str__", "__array__",
    })

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.counts: Counter[int] = Counter()
        self.calls: list[tuple[int, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.CONVERSIONS:
            self.counts[self.step] += 1
            self.calls.append((self.step, name))
        return func(*args, **(kwargs or {}))


def batches(device: torch.device | str = "cpu", seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(5, 8, generator=g).to(device)
        yield {"x": x, "y": x.flip(1)}


class CountingBus(Bus):
    """A bus that keeps a :class:`SyncCounter` active while it dispatches (for runs of the real loop)."""

    def __init__(self, counter: SyncCounter, ctx: Any = None) -> None:
        super().__init__(ctx)
        self.counter = counter

    def emit(self, event: Event) -> None:
        if self._dispatching:  # re-entrant emit: queued, the outer call dispatches it under the counter
            return super().emit(event)
        self.counter.step = event.step
        with self.counter:
            super().emit(event)


class FakeLoop:
    """Runs ``total_steps`` optimizer steps of SGD on a :class:`LoraAdapter`, emitting every event (clipping
    gradients to ``clip_grad_norm`` after ``GradsReady``, as the core does).

    ``switch_every``: steps per expert before switching (experts alternate). ``counter``: a :class:`SyncCounter`
    made active around every dispatch and around the core's ``gather`` (not around the fake model's own
    forward/backward/optimizer code). ``around_dispatch(step, is_log_step)`` returns a context manager entered
    around each dispatch of a step event (the CUDA sync-debug test uses it).
    """

    def __init__(self, observers: Sequence[Observer], *, adapter: LoraAdapter | None = None,
                 run_dir: Path | None = None, total_steps: int = 6, log_every: int = 3, grad_accum: int = 2,
                 switch_every: int = 2, start_step: int = 0, counter: SyncCounter | None = None,
                 around_dispatch: Callable[[int, bool], Any] | None = None, clip_grad_norm: float | None = None,
                 seed: int = 0) -> None:
        self.adapter = adapter or LoraAdapter()
        self.optimizer = torch.optim.SGD(self.adapter.param_groups(), lr=0.05)
        self.group_names = tuple(g["name"] for g in self.optimizer.param_groups)
        self.ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(),
                           run_dir=run_dir, adapter=self.adapter, optimizer=self.optimizer)
        self.bus = Bus(self.ctx)
        self.failures: list[ObserverFailed] = []
        self.bus.subscribe(ObserverFailed, lambda e, c: self.failures.append(e), priority=Priority.RECORDER)
        for observer in observers:
            self.bus.attach(observer)
        self.total_steps, self.log_every, self.grad_accum = total_steps, log_every, grad_accum
        self.switch_every, self.start_step = switch_every, start_step
        self.counter = counter
        self.clip_grad_norm = clip_grad_norm
        self.around_dispatch = around_dispatch
        self.logged: list[MetricsLogged] = []
        self.generator = torch.Generator().manual_seed(seed)

    def expert_for_step(self, step: int) -> str | None:
        return self.adapter.experts[((step - 1) // self.switch_every) % len(self.adapter.experts)]

    def log_steps(self) -> list[int]:
        return [s for s in range(self.start_step + 1, self.total_steps + 1) if self.is_log_step(s)]

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    @contextlib.contextmanager
    def _counting(self, step: int) -> Iterator[None]:
        if self.counter is None:
            yield
            return
        self.counter.step = step
        with self.counter:
            yield

    def emit(self, event: Event, is_log_step: bool = True) -> None:
        guard = self.around_dispatch(event.step, is_log_step) if self.around_dispatch else contextlib.nullcontext()
        with self._counting(event.step), guard:
            self.bus.emit(event)

    def run(self, status: str = "completed") -> list[MetricsLogged]:
        ctx, device = self.ctx, self.adapter.device
        self.bus.subscribe(MetricsLogged, lambda e, c: self.logged.append(e), priority=Priority.RECORDER)
        try:
            self.emit(RunStarted(step=self.start_step, run_dir=str(ctx.run_dir or ""), total_steps=self.total_steps,
                                 grad_accum=self.grad_accum, experts=self.adapter.experts, log_every=self.log_every))
            active: object = object()
            micro = 0
            for step in range(self.start_step + 1, self.total_steps + 1):
                expert = self.expert_for_step(step)
                log = self.is_log_step(step)
                if expert != active and isinstance(active, str | type(None)):
                    self.emit(ExpertSwitched(step=step, previous=active, expert=expert), log)
                active = ctx.state.expert = expert
                for index in range(1, self.grad_accum + 1):
                    micro += 1
                    common = dict(step=step, micro_step=micro, accumulation_index=index,
                                  ends_optimizer_step=index == self.grad_accum, is_log_step=log, expert=expert)
                    self.emit(StepStarted(**common), log)
                    x = torch.randn(5, 8, generator=self.generator).to(device)
                    batch = {"x": x, "y": x.flip(1)}
                    loss = self.adapter.loss(batch, expert)
                    ctx.live.loss = loss.detach()
                    self.emit(LossComputed(**common), log)
                    ctx.metrics.accumulate("train/loss", ctx.live.loss)
                    if expert is not None:
                        ctx.metrics.accumulate(f"train/loss/{expert}", ctx.live.loss)
                    (loss / self.grad_accum).backward()
                    ctx.live.clear()
                self.emit(GradsReady(step=step, is_log_step=log, expert=expert), log)
                if self.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.adapter.trainable_parameters(), self.clip_grad_norm)
                lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                ctx.state.step = step
                self.emit(OptimizerStepped(step=step, expert=expert, skipped=False, skip_reason=None, lrs=lrs,
                                           group_names=self.group_names, is_log_step=log), log)
                if log:
                    ctx.metrics.put("train/lr", lrs[0])
                    for name, lr in zip(self.group_names, lrs, strict=True):
                        ctx.metrics.put(f"train/lr/{name}", lr)
                    ctx.metrics.put("train/skipped_steps", 0.0)
                    with self._counting(step):
                        values = ctx.metrics.gather()  # the core's one device->host transfer
                    self.emit(MetricsLogged(step=step, expert=expert, values=values, elapsed_s=0.01 * step,
                                            total_steps=self.total_steps))
            self.emit(RunEnded(step=self.total_steps, status=status, reason=None))  # type: ignore[arg-type]
        finally:
            self.bus.close()
        return self.logged


class ConvertsEveryStep(Observer):
    """Negative control: an observer that turns a device tensor into a host value on every micro-step."""

    def __init__(self, how: str = "item") -> None:
        self.how = how
        self.seen: list[Any] = []

    @on(LossComputed)
    def on_loss(self, event: LossComputed, ctx) -> None:
        loss = ctx.live.loss
        convert = {"item": lambda t: t.item(), "float": float, "bool": lambda t: bool(t > 0),
                   "tolist": lambda t: t.tolist(), "cpu": lambda t: t.cpu(), "repr": repr}[self.how]
        self.seen.append(convert(loss))
