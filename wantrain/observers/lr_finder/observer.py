"""The learning-rate range test, as an observer: it drives a short run through the control object and reads the
losses the core logs. The loop has no LR-finder branch (docs/lr_finder.md).

The run it watches is assembled by ``wantrain.app`` for the test: ``steps * steps_per_lr`` optimizer steps per
trained expert, experts in turn (the high-noise expert's whole sweep first), ``log_every = 1``, no LoRA saver and no
checkpoints. Per optimizer step, at ``StepStarted``:

* ``control.set_lr(group, lr)`` with the rung's LR on the active expert's parameter group (the override lasts one
  step, so it is set at every step);
* the draws of the forward pass, by ``noise``: ``probe`` (the default) -- nothing: the rung trains with the normal
  random draws; ``stratified`` -- ``ctx.adapter.set_timestep_quantile(q)`` with q running through a van der Corput
  sequence over the sweep, so any window of consecutive rungs covers the timestep distribution evenly (noise stays
  random); ``random`` -- nothing; ``fixed`` -- the first rung records the generator state before each of its
  micro-steps (``ctx.generator.get_state()``, a host copy) and every later rung replays them through
  ``control.set_generator_state``, so every LR trains *and is measured* on the same timesteps and noise (biased
  low: the LoRA learns those draws; kept for comparison, docs/lr_finder.md).

What a rung's loss is: with ``noise = "probe"``, at the ``OptimizerStepped`` of the rung's last step the observer
evaluates a :class:`Probe` -- the same fixed clips, timesteps and noise at every rung, through the validation
capability (``adapter.validation_loss`` under ``ctx.control.evaluation()``: eval mode, no grad, nothing drawn from
the training streams) -- and puts its mean into the step's metrics as ``lr_finder/probe_loss`` (one extra host
transfer per rung, on a step that logs anyway). Otherwise it is the mean of the rung's ``train/loss``.

Decisions come from host values in the event log only: at each ``MetricsLogged`` the observer reads
``values["train/loss"]`` (finite-only mean of the step's micro-batches), ``values["train/nan_skipped_steps"]`` (a
rise means a micro-batch's loss or the gradient was not finite: the step's loss counts as NaN, which also catches
one bad micro-batch of several under ``grad_accum >= 2``) and ``values["lr_finder/probe_loss"]``. Feeding the
recorded ``MetricsLogged`` events to a fresh finder therefore reproduces every rung and suggestion (a test does).
``log_every = 1`` makes that one device->host transfer per step: the finder's explicit, documented cost (a few
bytes per step; the test is short). When a rung is complete the observer smooths it (bias-corrected EMA), emits
:class:`LrFinderRung`, and applies the stop rule (non-finite loss, or the median of the last 3 raw losses >
``diverge_factor`` x its lowest, after
``burn_in`` rungs). An expert's sweep ends at its last rung or at the stop: :class:`LrFinderResult` carries its
suggestions (``math.suggest``). A stopped expert that is not the last one skips its remaining optimizer steps
(``skip_optimizer_step``; their forward and backward passes still run, the price of a loop without a finder
branch); the last one asks the run to stop.

One expert per group of GPUs (``model.expert_groups``; ``concurrent=True``): the experts sweep side by side, each on
the ranks of its group, in ``steps * steps_per_lr`` optimizer steps (rung r of every expert at the same steps).
Each rank sets the LR, pins the draws and measures the probe of the expert it holds only, and puts the probe loss
as ``lr_finder/probe_loss/<expert>``; the core's reduction of the log step's metrics hands every rank the same
values, with each expert's own ``train/loss/<expert>``, ``train/nan_skipped_steps/<expert>`` and probe loss from its
group. So every rank judges every expert's rungs and suggestions alike, with no collective of its own, and rank 0's
event log holds every expert's ``LrFinderRung`` and ``LrFinderResult``. A group whose sweep stopped early skips its
optimizer steps until the other's ends; the run stops once every sweep has.

Outputs, in the run directory: ``lr_finder.csv`` (every rung), ``lr_finder.json`` (settings, suggestions, warnings),
``lr_finder.png`` (log-x chart: raw and smoothed loss, the running median the suggestions read, the suggested
LR's 90 % band, one marker per
method, the default starred); in ``tensorboard/`` (when ``observers.tensorboard``): scalars
``lr_finder/raw_loss``, ``lr_finder/smoothed_loss``, ``lr_finder/learning_rate`` at each rung's last step, and the
chart in the Images tab (``lr_finder/chart``, or ``lr_finder/chart/<expert>`` with two experts).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog

from wantrain.core.adapter import TimestepPinning
from wantrain.core.atomic import atomic_write
from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import (
    Event,
    MetricsLogged,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepStarted,
    register_event_type,
)
from wantrain.observers.lr_finder.config import LrFinderConfig
from wantrain.observers.lr_finder.math import LABELS, Smoother, Suggestion, diverged, level, suggest, sweep_lrs

log = structlog.get_logger("wantrain.lr_finder")

GROUP_OF_EXPERT = {"high_noise": "high_noise", "low_noise": "low_noise", None: "lora"}
PROBE_METRIC = "lr_finder/probe_loss"


@attrs.frozen
class Probe:
    """The fixed measurement of ``noise = "probe"`` (built by ``wantrain.app.lr_finder``): ``batches`` (cached,
    one clip each), ``timesteps`` per expert (fixed values in (0, 1)), ``seed`` of the fixed noise, and
    ``evaluate`` -- ``wantrain.observers.evaluation.validation.validate``'s signature ``(adapter, batches,
    timesteps, seed, control) -> {"val/loss": ..., ...}`` (host floats), handed in by the app so that the probe is
    exactly what ``[validation]`` computes (noise of (clip, timestep index) from its own generator, eval mode, no
    grad)."""

    batches: Sequence[Mapping[str, Any]]
    timesteps: Mapping[str | None, Sequence[float]]
    seed: int
    evaluate: Callable[..., dict[str, float]]

    def forwards(self, expert: str | None) -> int:
        """Forward passes (no grad) one measurement of ``expert`` costs."""
        return len(self.batches) * len(self.timesteps[expert])


@register_event_type
@attrs.frozen(slots=True, kw_only=True)
class LrFinderRung(Event):
    """One learning rate of the sweep is done. Fires while the ``MetricsLogged`` of the rung's last optimizer step
    is dispatched (``step``). ``rung`` is 0-based per expert; ``raw_loss`` is the mean logged loss of the rung's
    steps, ``smoothed_loss`` the bias-corrected EMA. Nobody acts on it; it puts the sweep in the event log."""

    expert: str | None
    rung: int
    lr: float
    raw_loss: float
    smoothed_loss: float
    train_loss: float | None = None  # the mean training loss of the rung's steps (raw_loss with noise != "probe")


@register_event_type
@attrs.frozen(slots=True, kw_only=True)
class LrFinderResult(Event):
    """An expert's sweep ended (``stop_reason`` says why when it stopped early). ``suggestions`` maps each method
    (``valley``, ``steepest``, ``minimum``) to its LR (None: too few points); ``default`` names the one used as
    ``suggested_lr`` (what ``--lr-finder-then-train`` trains with unless ``trusted`` is False: then it trains
    with the config's LR). ``warnings`` are sentences for the user, ``invalid`` those that question the suggestion
    (all of them); ``noise`` and ``descent`` the curve's noise per LR and its drop, ``band`` the suggested LR's 90 %
    bootstrap band (``lr_finder.math``)."""

    expert: str | None
    suggestions: dict[str, float | None]
    default: str
    suggested_lr: float | None
    stop_reason: str | None
    warnings: tuple[str, ...]
    rungs: int
    invalid: tuple[str, ...] = ()
    noise: float | None = None
    descent: float | None = None
    band: tuple[float, float] | None = None

    @property
    def trusted(self) -> bool:
        return self.suggested_lr is not None and not self.invalid


def van_der_corput(i: int, base: int = 2) -> float:
    """The i-th element (i >= 1) of the van der Corput sequence in ``base``: 1/2, 1/4, 3/4, 1/8, 5/8, ..."""
    q, denom = 0.0, 1.0
    while i:
        i, digit = divmod(i, base)
        denom *= base
        q += digit / denom
    return q


@attrs.define
class _Sweep:
    """One expert's sweep: the rungs done so far and how it ended."""

    expert: str | None
    smoother: Smoother
    rung_losses: list[float] = attrs.field(factory=list)  # training losses of the current rung's steps
    rows: list[dict[str, Any]] = attrs.field(factory=list)  # one per completed rung
    best: float = math.inf  # the lowest stop-rule level (math.level) so far
    stop_reason: str | None = None
    result: Suggestion | None = None
    done: bool = False
    generator_states: dict[int, Any] = attrs.field(factory=dict)  # micro index in the rung -> state (noise=fixed)


class LrFinder(Observer):
    """The range test (see the module docstring). Built by the runner; ``attach_to(bus)`` attaches it and lets it
    emit its own events. ``results`` (expert -> :class:`LrFinderResult`) and ``finished`` are read after the run."""

    priority = Priority.CONTROLLER
    critical = True  # a broken finder makes the whole test meaningless

    def __init__(self, cfg: LrFinderConfig, *, experts: tuple[str | None, ...], grad_accum: int,
                 run_dir: Path | None = None, tensorboard: bool = False, probe: Probe | None = None,
                 concurrent: bool = False) -> None:
        self.cfg = cfg
        self.concurrent = concurrent  # model.expert_groups: every expert's sweep at the same steps (module docstring)
        self.probe = probe
        self.experts = tuple(experts)
        self.grad_accum = grad_accum
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tensorboard = tensorboard
        self.lrs = sweep_lrs(cfg.start_lr, cfg.end_lr, cfg.steps, cfg.mode)
        self.steps_per_expert = cfg.steps * cfg.steps_per_lr
        self.total_steps = self.steps_per_expert * (1 if concurrent else len(self.experts))
        self.sweeps = [_Sweep(e, Smoother(cfg.smoothing)) for e in self.experts]
        self.results: dict[str | None, LrFinderResult] = {}
        self._bus: Any = None
        self._writer: Any = None
        self._warned_no_quantile = False
        self._nan_skipped: dict[str, float] = {}  # train/nan_skipped_steps[/<expert>] at the last MetricsLogged

    def attach_to(self, bus: Any) -> LrFinder:
        self._bus = bus
        bus.attach(self)
        return self

    @property
    def finished(self) -> bool:
        """Every expert's sweep reached its last rung or its stop rule."""
        return all(s.done for s in self.sweeps)

    # -- where a step sits in the sweep ------------------------------------------------------------------------
    def locate(self, step: int) -> tuple[int, int, int]:
        """(expert index, rung, step index within the rung) of optimizer step ``step`` (1-based); ``concurrent``:
        the first expert's (every expert is at that rung)."""
        local = (step - 1) % self.steps_per_expert
        index = 0 if self.concurrent else (step - 1) // self.steps_per_expert
        return index, local // self.cfg.steps_per_lr, local % self.cfg.steps_per_lr

    def _positions(self, step: int) -> list[tuple[int, _Sweep, int, int]]:
        """(expert index, sweep, rung, step index within the rung) of every sweep that step ``step`` belongs to:
        one, or with ``concurrent`` all of them."""
        index, rung, in_rung = self.locate(step)
        indices = range(len(self.sweeps)) if self.concurrent else (index,)
        return [(i, self.sweeps[i], rung, in_rung) for i in indices]

    def _held(self, sweep: _Sweep, ctx: Any) -> bool:
        """Whether this process trains ``sweep``'s expert (one at a time: always; ``concurrent``: its group's)."""
        return not self.concurrent or sweep.expert in ctx.adapter.experts

    def _key(self, name: str, sweep: _Sweep) -> str:
        """The logged metric ``name`` of ``sweep``'s expert: ``name`` itself while one expert trains at a time,
        ``name/<expert>`` with ``concurrent`` (each group's own value)."""
        return f"{name}/{sweep.expert or 'lora'}" if self.concurrent else name

    # -- handlers ----------------------------------------------------------------------------------------------
    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx: Any) -> None:
        if event.total_steps != self.total_steps or event.log_every != 1:
            raise RuntimeError(f"the LR finder needs a run of {self.total_steps} steps logging every step; got "
                               f"{event.total_steps} steps, log_every {event.log_every} (assemble it with "
                               "wantrain.app.lr_finder)")
        if self.cfg.noise == "probe" and self.probe is None:
            raise RuntimeError("lr_finder.noise = 'probe' needs a Probe (wantrain.app.lr_finder builds it)")
        if self.tensorboard and self.run_dir is not None:
            from tensorboardX import SummaryWriter

            # our own file in the run's TensorBoard folder (a unique suffix: the metrics writer has its own)
            self._writer = SummaryWriter(logdir=str(self.run_dir / "tensorboard"), flush_secs=10,
                                         filename_suffix=f".lr_finder.{time.time_ns():020d}")

    @on(StepStarted)
    def on_step_started(self, event: StepStarted, ctx: Any) -> None:
        for _, sweep, rung, in_rung in self._positions(event.step):
            if self._held(sweep, ctx):
                self._start_step(event, ctx, sweep, rung, in_rung)

    def _start_step(self, event: StepStarted, ctx: Any, sweep: _Sweep, rung: int, in_rung: int) -> None:
        if sweep.done:
            ctx.control.skip_optimizer_step(f"lr_finder: the {sweep.expert or 'lora'} sweep has ended")
            return
        ctx.control.set_lr(GROUP_OF_EXPERT[sweep.expert], self.lrs[rung])
        micro = in_rung * self.grad_accum + event.accumulation_index - 1  # micro-step within the rung
        if self.cfg.noise == "fixed":
            if rung == 0:
                sweep.generator_states[micro] = ctx.generator.get_state()  # host copy; no device sync
            elif micro in sweep.generator_states:
                ctx.control.set_generator_state(sweep.generator_states[micro])
        elif self.cfg.noise == "stratified":
            per_rung = self.cfg.steps_per_lr * self.grad_accum
            if isinstance(ctx.adapter, TimestepPinning):  # optional: without it the draws stay random
                ctx.adapter.set_timestep_quantile(van_der_corput(rung * per_rung + micro + 1))
            elif not self._warned_no_quantile:
                self._warned_no_quantile = True
                log.warning("lr_finder_no_stratified_timesteps", reason="the model adapter has no "
                            "set_timestep_quantile(); timesteps are drawn at random")

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx: Any) -> None:
        """``noise = "probe"``: measure the LoRA after the rung's last step (its value joins this step's log)."""
        if self.cfg.noise != "probe" or event.step > self.total_steps:
            return
        for _, sweep, _, in_rung in self._positions(event.step):
            if sweep.done or in_rung < self.cfg.steps_per_lr - 1 or not self._held(sweep, ctx):
                continue
            values = self.probe.evaluate(ctx.adapter, self.probe.batches, self.probe.timesteps[sweep.expert],
                                         self.probe.seed, ctx.control)
            ctx.metrics.put(self._key(PROBE_METRIC, sweep), values.get("val/loss", math.nan))

    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx: Any) -> None:
        if event.step < 1 or event.step > self.total_steps:
            return  # another observer's own line (step 0)
        for index, sweep, rung, in_rung in self._positions(event.step):
            if not sweep.done:
                self._take_rung(event, ctx, index, sweep, rung, in_rung)
        if self.concurrent and self.finished and event.step < self.total_steps:
            ctx.control.request_stop("lr_finder: every expert's sweep finished")

    def _take_rung(self, event: MetricsLogged, ctx: Any, index: int, sweep: _Sweep, rung: int, in_rung: int) -> None:
        """Step ``event.step``'s logged loss into ``sweep``; at the rung's last step the rung, and the stop rule."""
        values = event.values
        name = self._key("train/nan_skipped_steps", sweep)
        before = self._nan_skipped.get(name, 0.0)
        skipped = float(values.get(name, before))
        bad_step, self._nan_skipped[name] = skipped > before, skipped  # a non-finite micro-loss or gradient
        sweep.rung_losses.append(math.nan if bad_step else float(values.get(self._key("train/loss", sweep), math.nan)))
        if in_rung < self.cfg.steps_per_lr - 1:
            return
        train = math.fsum(sweep.rung_losses) / len(sweep.rung_losses)
        sweep.rung_losses.clear()
        if self.cfg.noise == "probe":
            raw = float(values.get(self._key(PROBE_METRIC, sweep), math.nan)) if math.isfinite(train) else math.nan
        else:
            raw = train
        smoothed = sweep.smoother.add(raw) if math.isfinite(raw) else math.nan
        current = level([r["raw_loss"] for r in sweep.rows] + [raw]) if math.isfinite(raw) else math.nan
        if math.isfinite(current):
            sweep.best = min(sweep.best, current)
        lr = self.lrs[rung]
        sweep.rows.append({"expert": sweep.expert, "rung": rung, "step": event.step, "lr": lr, "raw_loss": raw,
                           "smoothed_loss": smoothed, "train_loss": train})
        self._emit(LrFinderRung(step=event.step, expert=sweep.expert, rung=rung, lr=lr, raw_loss=raw,
                                smoothed_loss=smoothed, train_loss=train))
        if self._writer is not None:
            for tag, value in (("raw_loss", raw), ("smoothed_loss", smoothed), ("learning_rate", lr)):
                self._writer.add_scalar(f"lr_finder/{tag}", value, event.step)
        reason = diverged(raw, current, sweep.best, rung, factor=self.cfg.diverge_factor, burn_in=self.cfg.burn_in)
        if reason is not None or rung == self.cfg.steps - 1:
            sweep.stop_reason = None if reason is None else f"stopped at LR {lr:.3g}: {reason}"
            self._finish(sweep, event.step)
            if reason is not None and index == len(self.sweeps) - 1 and not self.concurrent:
                ctx.control.request_stop(f"lr_finder: sweep finished ({sweep.stop_reason})")

    @on(RunEnded)
    def on_run_ended(self, event: RunEnded, ctx: Any) -> None:
        for sweep in self.sweeps:  # an interrupted sweep still reports what it measured
            if not sweep.done and sweep.rows and sweep.result is None:
                sweep.stop_reason = f"interrupted ({event.reason or event.status})"
                self._finish(sweep, event.step, emit=False)
        if self.run_dir is not None and any(s.rows for s in self.sweeps):
            self.write_outputs(self.run_dir)
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- the end of one expert's sweep -------------------------------------------------------------------------
    def _finish(self, sweep: _Sweep, step: int, *, emit: bool = True) -> None:
        sweep.done = emit  # an interrupted sweep (emit=False) is not "finished"
        lrs = [r["lr"] for r in sweep.rows]
        losses = [r["raw_loss"] for r in sweep.rows]
        sweep.result = suggest(lrs, losses, beta=self.cfg.smoothing, default=self.cfg.suggestion,
                               stopped_early=sweep.stop_reason is not None, probe=self.cfg.noise == "probe")
        result = LrFinderResult(
            step=step, expert=sweep.expert, suggestions=dict(sweep.result.lrs), default=sweep.result.default,
            suggested_lr=sweep.result.lr, stop_reason=sweep.stop_reason, warnings=sweep.result.warnings,
            rungs=len(sweep.rows), invalid=sweep.result.invalid,
            noise=sweep.result.noise if math.isfinite(sweep.result.noise) else None,
            descent=sweep.result.descent if math.isfinite(sweep.result.descent) else None,
            band=sweep.result.band,
        )
        self.results[sweep.expert] = result
        log.info("lr_finder_result", expert=sweep.expert, suggested_lr=result.suggested_lr,
                 suggestions=result.suggestions, stop_reason=result.stop_reason, warnings=list(result.warnings))
        if emit:
            self._emit(result)
        if self._writer is not None and sweep.rows:
            from wantrain.observers.lr_finder.chart import chart_figure

            tag = "lr_finder/chart" if len(self.sweeps) == 1 else f"lr_finder/chart/{sweep.expert}"
            self._writer.add_figure(tag, chart_figure([sweep], self.cfg), step, close=True)

    def _emit(self, event: Event) -> None:
        if self._bus is not None:
            self._bus.emit(event)

    # -- files -------------------------------------------------------------------------------------------------
    def write_outputs(self, run_dir: Path) -> None:
        """``lr_finder.csv``, ``lr_finder.json`` and ``lr_finder.png`` in ``run_dir``."""
        from wantrain.observers.lr_finder.chart import chart_figure

        rows = []
        for sweep in self.sweeps:
            curve = list(sweep.result.curve) if sweep.result is not None else []
            curve += [None] * (len(sweep.rows) - len(curve))
            for r, c in zip(sweep.rows, curve, strict=True):  # the curve the suggestions read; empty: left out
                rows.append({**r, "expert": r["expert"] or "", "centred_loss": math.nan if c is None else c})
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=["expert", "rung", "step", "lr", "raw_loss", "smoothed_loss",
                                                   "centred_loss", "train_loss"])
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(run_dir / "lr_finder.csv", table.getvalue(), what="LR finder table")  # core.atomic
        summary = {
            "settings": attrs.asdict(self.cfg),
            "experts": {(e or "lora"): attrs.asdict(r) for e, r in self.results.items()},
        }
        atomic_write(run_dir / "lr_finder.json", json.dumps(summary, indent=2, default=str), what="LR finder summary")
        figure = chart_figure([s for s in self.sweeps if s.rows], self.cfg)
        atomic_write(run_dir / "lr_finder.png", lambda tmp: figure.savefig(tmp, dpi=110, format="png"),
                     what="LR finder chart")


def summary_lines(results: dict[str | None, LrFinderResult]) -> list[str]:
    """What ``wantrain run --lr-finder`` prints: per expert the suggestions (default marked), why it stopped, and
    the warnings."""
    lines = []
    for expert, r in results.items():
        name = expert or "lora"
        head = f"lr_finder [{name}]: suggested LR {r.suggested_lr:.3g} ({LABELS.get(r.default, r.default)})" \
            if r.suggested_lr else \
            f"lr_finder [{name}]: no suggestion"
        lines.append(head)
        for method, lr in r.suggestions.items():
            mark = "  <- default" if method == r.default else ""
            lines.append(f"  {LABELS.get(method, method):<12} {'-' if lr is None else format(lr, '.3g')}{mark}")
        if r.band is not None:
            lines.append(f"  band         {r.band[0]:.3g}-{r.band[1]:.3g} (90 %, bootstrap over the LRs)")
        if r.stop_reason:
            lines.append(f"  {r.stop_reason}")
        lines.extend(f"  warning: {w}" for w in r.warnings)
        if r.suggested_lr and r.invalid:
            lines.append("  not trusted (questioned above): --lr-finder-then-train trains with the config's LR")
    return lines
