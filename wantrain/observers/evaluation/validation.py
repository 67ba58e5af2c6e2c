"""Validation loss at fixed timesteps and fixed noise: a figure that is comparable across steps and runs.

The training loss depends mostly on which timestep each step happened to draw; this one does not. Every validation
evaluates each clip of the validation set at each timestep of ``validation.timesteps`` with noise drawn from its own
generator, seeded from ``validation.seed``, the clip's index and the timestep's index (the same noise at every
validation), by the expert that owns the timestep, in eval mode under ``torch.no_grad``. Nothing is drawn from the
training random streams, so a run with validation trains bitwise like one without.

Metrics (host floats, docs/metrics.md):

* ``val/loss`` -- mean flow-matching MSE over every (clip, timestep) pair evaluated.
* ``val/loss/<expert>`` -- the same over the timesteps that expert owns (two-expert models only).
* ``val/loss/t_<t>`` -- the mean over the clips at one timestep (``val/loss/t_0.5``).

When: at step 0 (the baseline, at ``RunStarted`` of a fresh run), every ``validation.every`` optimizer steps and
at the last step, and at the step a person asks for it (``ControlRequested``: ``wantrain ctl RUN validate``, the
page's button). A stop (Ctrl-C, SIGTERM, an observer's request) skips the validation of its step, so the LoRA and
the checkpoint are saved at once (a preemption's grace period is short); the run log says so. On a log step the
values join the step's ``MetricsLogged`` through ``ctx.metrics`` (one line, one event); at step 0 and at other
steps the observer emits a ``MetricsLogged`` of its own holding only ``val/*``. Each validation syncs the device
once (it is rare) and logs ``validation`` with its wall time in the run log.

With two experts, the inactive one comes onto the device for its timesteps (the core brings it in with its
optimizer state: ``ctx.control.evaluation()``) and goes back; the training expert is active again afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
import torch

from wantrain.core.adapter import ValidationCapable, evaluation_session
from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import ControlRequested, MetricsLogged, OptimizerStepped, RunStarted

log = structlog.get_logger("wantrain.validation")


def noise_seed(seed: int, clip: int, t_index: int) -> int:
    """The seed of the noise of (clip, timestep): fixed across validations and independent of evaluation order."""
    return (seed * 1_000_003 + clip * 1_009 + t_index) % (2**63 - 1)


def metric_name(t: float) -> str:
    return f"val/loss/t_{t:g}"


def validate(adapter: ValidationCapable, batches: Sequence[Mapping[str, Any]], timesteps: Sequence[float],
             seed: int, control: Any = None, *, sync: Any = None,
             clip_indices: Sequence[int] | None = None, run_experts: Sequence[Any] | None = None,
             padding: Sequence[Mapping[str, Any]] = ()) -> dict[str, float]:
    """The ``val/*`` metrics of ``adapter`` on ``batches`` (cached batches: ``latents``, ``text_embeds``, ...).

    ``clip_indices``: each batch's index in the whole validation set (its noise seed; default 0, 1, ...). Under
    torchrun each rank passes its share and ``sync`` (``core.parallel.distributed``) adds up the ranks' sums: per
    timestep
    the float64 sum of the per-clip losses (each clip's loss a float32 mean over its elements) and the clip count,
    so the mean is the same as one process's up to the order of that float64 sum. Timesteps whose expert is not
    trained are left out. Experts are visited in the adapter's order starting with the active one, brought in by
    the core (``control.evaluation()``; without ``control``, outside a run: ``core.adapter.evaluation_session``);
    the active expert is restored at the end. One device->host transfer (and, under torchrun, one all-reduce).

    ``run_experts``: every expert of the run (``model.expert_groups``: every group's, of which ``adapter`` holds
    one). A timestep whose expert another group holds is evaluated there, on that group's share of the clips: this
    rank adds a sum and a count of zero for it, and the all-reduce brings that group's sums to every rank.

    ``padding``: batches evaluated after this rank's share at each timestep and left out of every figure. Under a
    layout whose forward is a collective (fsdp, Ulysses) every rank must run as many forwards as the others: a
    rank whose share is one clip short evaluates a padding batch instead (:func:`evaluation_share`).
    """
    training_expert = adapter.active
    indices = list(range(len(batches))) if clip_indices is None else list(clip_indices)
    elsewhere = [e for e in run_experts or () if e not in adapter.experts]
    owners: dict[Any, list[int]] = {}
    for i, t in enumerate(timesteps):
        expert = adapter.expert_for_timestep(t)
        if expert != "untrained":
            owners.setdefault(expert, []).append(i)
        elif len(elsewhere) == 1 and sync is not None:  # the other group's expert owns it
            owners.setdefault(elsewhere[0], []).append(i)
    here = [e for e in owners if e not in elsewhere]
    experts = list(run_experts or adapter.experts)
    order = sorted(owners, key=lambda e: (e != training_expert, experts.index(e)))
    losses: dict[int, list[torch.Tensor]] = {}
    with control.evaluation() if control is not None else evaluation_session(adapter) as bring_in:
        for expert in [e for e in order if e in here]:
            bring_in(expert)
            for i in owners[expert]:
                for c, batch in zip(indices, batches, strict=True):
                    shape = batch["latents"].shape
                    noise = torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(seed, c, i)))
                    losses.setdefault(i, []).append(adapter.validation_loss(batch, timesteps[i], noise))
                for batch in padding:  # the other ranks' forwards have a partner; the loss is dropped
                    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(seed))
                    adapter.validation_loss(batch, timesteps[i], noise)
    evaluated = sorted(i for e in order for i in owners[e])
    if not evaluated:
        return {}
    mine = [v for i in evaluated for v in losses.get(i, [])]
    host = torch.stack(mine).tolist() if mine else []
    sums, counts, pos = [], [], 0  # the one device->host transfer
    for i in evaluated:
        n = len(losses.get(i, []))
        sums.append(sum(host[pos:pos + n]))
        counts.append(float(n))
        pos += n
    if sync is not None:
        reduced = sync.sum_values(sums + counts)
        sums, counts = reduced[:len(evaluated)], reduced[len(evaluated):]
    per_t = {i: total / count for i, total, count in zip(evaluated, sums, counts, strict=True) if count > 0}
    if not per_t:
        return {}
    out = {"val/loss": sum(per_t.values()) / len(per_t)}
    if len(experts) > 1:
        for expert in order:
            mine = [per_t[i] for i in owners[expert] if i in per_t]
            out[f"val/loss/{expert}"] = sum(mine) / len(mine)
    for i, value in per_t.items():
        out[metric_name(timesteps[i])] = value
    return out


class Validation(Observer):
    """Computes the ``val/*`` metrics on a fixed set of cached batches (see the module docstring)."""

    priority = Priority.SINK
    needs = (ValidationCapable,)

    def __init__(self, batches: Sequence[Mapping[str, Any]], *, timesteps: Sequence[float], seed: int,
                 every: int, sync: Any = None, clip_indices: Sequence[int] | None = None,
                 clips_total: int | None = None, run_experts: Sequence[Any] | None = None,
                 padding: Sequence[Mapping[str, Any]] = ()) -> None:
        self.batches = list(batches)
        self.padding = list(padding)  # evaluated, never counted: every rank runs as many forwards (validate)
        self.clip_indices = list(range(len(self.batches))) if clip_indices is None else list(clip_indices)
        # the validation set's size (torchrun: over every rank; this rank holds `batches`, its share)
        self.clips_total = len(self.batches) if clips_total is None else clips_total
        self.sync = sync  # torchrun: this rank's share of the clips, the sums added up over the ranks
        self.timesteps = list(timesteps)
        self.run_experts = run_experts  # expert groups: every group's expert (validate)
        self.seed = seed
        self.every = every
        self.seconds = 0.0  # wall time spent validating in this process
        self._bus: Any = None
        self._started = time.perf_counter()

    def attach_to(self, bus: Any) -> None:
        """Attach to ``bus`` and keep it: validations at step 0 and between log steps emit their own
        ``MetricsLogged`` there (queued after the current event, as the bus does for every handler's emit)."""
        self._bus = bus
        bus.attach(self)

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self._started = time.perf_counter()
        if event.step == 0:  # a resumed run's last validation is already on record
            self._emit(0, self._run(0, ctx), ctx, event.total_steps)

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx) -> None:
        total = ctx.state.total_steps
        # under torchrun the stop agreed by every rank (sync.should_stop), never one rank's own request yet: the
        # ranks validate together (the sums' all-reduce; under fsdp and Ulysses every forward) or not at all
        stopping = ctx.control.stop_requested if self.sync is None else self.sync.should_stop(ctx.control)
        if stopping:  # the run's last step: no end-of-run validation, the saves come first
            log.info("validation skipped: stopping", step=event.step,
                     reason="a stop saves the LoRA and the checkpoint first")
            return
        if not (event.step % self.every == 0 or event.step == total):
            return
        values = self._run(event.step, ctx)
        if event.is_log_step:  # the core logs this step
            for name, value in values.items():
                ctx.metrics.put(name, value)
        else:
            self._emit(event.step, values, ctx, total)

    @on(ControlRequested)
    def on_control_requested(self, event: ControlRequested, ctx) -> None:
        """A person asked for a validation now (``wantrain ctl RUN validate``, the page's button)."""
        if event.action == "validate" and event.refused is None:
            self._emit(event.step, self._run(event.step, ctx), ctx, ctx.state.total_steps)

    def _run(self, step: int, ctx) -> dict[str, float]:
        started = time.perf_counter()
        values = validate(ctx.adapter, self.batches, self.timesteps, self.seed, ctx.control, sync=self.sync,
                          clip_indices=self.clip_indices, run_experts=self.run_experts, padding=self.padding)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        log.info("validation", step=step, seconds=round(seconds, 3), total_seconds=round(self.seconds, 3),
                 clips=self.clips_total, loss=values.get("val/loss"),
                 **({"clips_this_rank": len(self.batches)} if len(self.batches) != self.clips_total else {}))
        return values

    def _emit(self, step: int, values: dict[str, float], ctx, total: int) -> None:
        if values and self._bus is not None:
            self._bus.emit(MetricsLogged(step=step, expert=ctx.state.expert, values=values,
                                         elapsed_s=time.perf_counter() - self._started, total_steps=total))


def evaluation_share(clips: int, place: int, ranks: int, *, in_step: bool) -> tuple[list[int], int]:
    """The validation clips a rank evaluates -- every ``ranks``-th from ``place`` (its data-parallel place) -- and,
    with ``in_step`` (a layout whose forward is a collective: fsdp, Ulysses), how many padding forwards bring it
    to the longest share (so every rank runs as many forwards); without it, 0."""
    share = list(range(place, clips, ranks))
    longest = -(-clips // ranks)
    return share, (longest - len(share) if in_step else 0)


def cached_batches(data: Any, adapter: Any) -> list[dict[str, torch.Tensor]]:
    """One cached batch per validation clip (tensors only, on the CPU), read after ``ensure_cache``."""
    import itertools

    batches = itertools.islice(iter(data.stream(adapter)), data.steps_per_epoch)
    return [{k: v.cpu() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in batches]
