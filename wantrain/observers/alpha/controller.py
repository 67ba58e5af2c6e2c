"""The progressive alpha controller (seed 001): per expert, phases of rising LoRA alpha, each left when its exit
criteria hold. Config ``[lora.alpha_schedule]``; formulas, presets and how to read the metrics: docs/alpha_schedule.md.

Where it acts (the loop's pseudocode is in ``wantrain.core.events``)::

    LossComputed       add the micro-step's device loss to this step's sum               (device, no sync)
    GradsReady         push the step's mean loss into the expert's loss window; compute the expert's gradient
                       sign agreement with its previous step and push it into its stability window (device)
    OptimizerStepped   on a log step only: put each trained expert's window statistics into ctx.metrics
                       (device tensors) and its phase, alpha and step counts (host numbers)
    [core gathers]     the one device->host transfer of the interval carries them into MetricsLogged.values
    MetricsLogged      decide from those host values and the controller's state (AlphaPolicy, pure); for each
                       transition request it (``ctx.control.set_lora_alpha``) and emit AlphaChanged
    [core applies]     the core changes alpha (the adapter's ``change_lora_alpha``, with the optimizer) after the
                       step's events -- between optimizer steps, before the checkpoint of this step is written
    CheckpointSaved    (write_sidecars) <checkpoint>/<stem>_alpha_scheduler.json beside the checkpoint's state

Metrics, per expert key ``<k>`` (``high_noise``, ``low_noise``, or ``lora`` for a single-transformer model), each
logged at the log steps of the intervals in which that expert trained:

* decision inputs: ``alpha/steps/<k>`` (optimizer steps the expert has trained in the run), ``alpha/loss_slope/<k>``
  (loss/step), ``alpha/loss_r2/<k>``, ``alpha/loss_cv/<k>``, ``alpha/loss_improvement_rate/<k>`` (relative decrease
  per 100 steps), ``alpha/loss_samples/<k>``, ``alpha/gradient_stability/<k>`` (0..1) -- see ``stats``;
* state during the interval (before this log step's decision): ``alpha/phase/<k>`` (phase index),
  ``alpha/steps_in_phase/<k>``, ``alpha/linear_alpha/<k>``; and ``alpha/phase``, the lowest phase index over the
  experts (the run is in phase i once every expert has reached it; the report shades it).

``<run_dir>/alpha_metrics.jsonl`` carries the seed's fields, one line per evaluated expert and log step.

One expert per group of GPUs (``model.expert_groups``): every rank's controller holds the policy of every expert of
the run. Each rank computes the statistics of the expert it trains (its group's); the core's reduction of the log
step's metrics (a collective every rank enters at every log step) hands every rank the same values, with each
expert's statistics from its own group. So every rank decides every expert's transitions, identically and at the
same step, without a collective of its own; each rank requests only the changes of the experts it holds, and rank 0,
which records the event log, emits every expert's ``AlphaChanged`` (the low-noise group's decisions included).
Replay: :class:`AlphaPolicy` is a pure function of ``MetricsLogged.values`` and its own state, so feeding a
recorded run's MetricsLogged events to a fresh policy (or a fresh controller without an adapter) reproduces its
AlphaChanged events exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

import attrs
import numpy as np
import structlog
import torch

from wantrain.core.adapter import AlphaChangeable
from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import (
    Event,
    ExpertSwitched,
    GradsReady,
    LossComputed,
    MetricsLogged,
    OptimizerStepped,
    RunStarted,
    StepStarted,
    register_event_type,
)
from wantrain.core.events.log import cut_back
from wantrain.core.rundir import open_append
from wantrain.observers.alpha.config import AlphaScheduleConfig
from wantrain.observers.alpha.stats import DeviceWindow, SignAgreement, loss_statistics, window_mean

log = structlog.get_logger("wantrain.alpha")

STATISTICS = ("loss_slope", "loss_r2", "loss_cv", "loss_improvement_rate", "loss_improvement_rate_se",
              "loss_improvement_rate_dof", "loss_samples", "gradient_stability")


@register_event_type
@attrs.frozen(slots=True, kw_only=True)
class AlphaChanged(Event):
    """The alpha controller moved ``expert`` to its next phase at log step ``step`` (emitted from its
    ``MetricsLogged`` handler with the request to the core, which changes alpha once the step's events are
    dispatched and before this step's checkpoint). ``statistics`` are the logged values that justified it,
    ``checks`` each exit check's value and threshold (``earlier_window``: the expert step of the plateau test one
    window earlier that also passed); ``steps_in_phase`` the expert's steps in the phase it left. It also goes to
    the console and log.jsonl (``alpha_changed``). Sinks may record it; nobody needs to act on it."""

    expert: str | None
    from_phase: str
    to_phase: str
    from_alpha: float
    to_alpha: float
    phase_index: int
    steps_in_phase: int
    transition: str
    statistics: dict[str, float]
    checks: dict[str, dict[str, float]] = attrs.field(factory=dict)


@register_event_type
@attrs.frozen(slots=True, kw_only=True)
class AlphaHeld(Event):
    """At a look (``look``, 1-based in the phase) the alpha controller found ``expert``'s loss *rising* and held it
    in its phase (``phase``, ``phase_index``): ``rate`` is the window's improvement rate per 100 expert steps
    (negative: rising), ``se`` its standard error (NaN with ``signal = "validation"``). Emitted from the
    ``MetricsLogged`` handler, so it is in the event log and replays like ``AlphaChanged``; nobody acts on it."""

    expert: str | None
    phase: str
    phase_index: int
    steps_in_phase: int
    look: int
    rate: float
    se: float


def expert_key(expert: str | None) -> str:
    return expert or "lora"


SPENDING_ALPHA = 0.025
"""The plateau rule's error budget: over all the looks of one phase, a loss still falling at exactly δ per 100
steps ends it with probability at most this (alpha spending, :func:`look_level`)."""

RISE_LEVEL = 0.05
"""One-sided level of the rising test: a window whose rate lies below 0 with this confidence (I + t·se < 0) holds
the phase (a held phase is the safe error, so no spending here)."""


def look_level(look: int | np.ndarray) -> np.ndarray:
    """The level spent at look ``look`` (1, 2, ...; array-valued) of a phase: ``SPENDING_ALPHA·6/(π²·look²)``; over
    any number of looks the levels sum to at most ``SPENDING_ALPHA`` (Σ 1/j² = π²/6), so a phase that never ends
    has spent no more than its budget."""
    look = np.asarray(look, dtype=float)
    return SPENDING_ALPHA * 6.0 / (math.pi ** 2 * look * look)


_NORMAL = NormalDist()


def t_quantile(level: float | np.ndarray, dof: float | np.ndarray) -> np.ndarray:
    """The upper ``level`` quantile of Student's t with ``dof`` degrees of freedom (array-valued), by the
    Cornish-Fisher expansion to 1/dof³ (within 0.2 % of the exact value from 10 degrees of freedom; the windows'
    batch means give 18); NaN for dof < 1."""
    z = np.vectorize(lambda p: _NORMAL.inv_cdf(1.0 - p))(np.asarray(level, dtype=float))
    v = np.asarray(dof, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
             + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))
    return np.where(v >= 1, t, np.nan)


def plateau_look(rate, se, dof, look, delta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two one-sided tests of look ``look`` on a window (arrays broadcast; the policy and the property tests
    call this same function): ``(stopped, rising, bound)`` with ``bound = I + t(look_level(look), dof)·se`` the
    upper confidence bound of the improvement rate, ``stopped = bound < δ`` (the loss no longer falls δ per 100
    steps, at the look's spent level) and ``rising = I + t(RISE_LEVEL, dof)·se < 0`` (it rises, with 95 %
    confidence). NaN inputs give ``stopped`` False and ``rising`` False."""
    rate, se = np.asarray(rate, dtype=float), np.asarray(se, dtype=float)
    bound = rate + t_quantile(look_level(look), dof) * se
    with np.errstate(invalid="ignore"):
        stopped = np.isfinite(bound) & (bound < delta)
        rising = np.isfinite(se) & (rate + t_quantile(RISE_LEVEL, dof) * se < 0)
    return stopped, rising, bound


@attrs.define
class ExpertPhase:
    """Where one expert stands: its phase index, its step count (``alpha/steps/<k>``) when that phase began, the
    plateau looks taken in this phase and the expert step of the last one (-1: none); with ``signal =
    "validation"`` the validations of this phase as ``[expert steps, validation loss]`` pairs (the last
    ``validation_patience + 1`` kept) and ``anchor``, the last ``[run step, expert steps]`` seen."""

    phase: int = 0
    phase_start: int = 0
    looks: int = 0
    last_look: float = -1.0
    validations: list[list[float]] = attrs.field(factory=list)
    anchor: list[float] = attrs.field(factory=list)


@attrs.frozen
class Check:
    criterion: str
    value: float
    threshold: float
    ok: bool


def validation_key(expert: str | None) -> str:
    """The validation metric of ``expert``: its own timesteps' loss (``val/loss/<expert>``), or ``val/loss`` for a
    single-transformer model."""
    return "val/loss" if expert is None else f"val/loss/{expert}"


def validation_rates(validations: list[list[float]]) -> list[float]:
    """The relative decrease per 100 expert steps between consecutive validations ``[expert steps, loss]``:
    ``r_j = 100·(v_{j-1} - v_j) / (|v_{j-1}|·(e_j - e_{j-1}))`` (NaN where undefined)."""
    out = []
    for (s0, v0), (s1, v1) in zip(validations, validations[1:]):
        ok = s1 > s0 and v0 != 0 and math.isfinite(v0) and math.isfinite(v1)
        out.append(100.0 * (v0 - v1) / (abs(v0) * (s1 - s0)) if ok else math.nan)
    return out


class AlphaPolicy:
    """The decisions, on host values only: no tensors, no clock, no randomness.

    :meth:`observe` takes a log step's ``MetricsLogged.values`` and returns the transitions it decides (updating
    the phase state); :attr:`looks` then lists this call's looks (the tests' outcome, for the metrics file and
    :class:`AlphaHeld`). With ``signal = "train"`` an expert's phase is judged only at a *look*: a log step at
    which it has ``max(min_steps, window)`` steps in the phase, ``loss_samples >= min_samples``, and ``window``
    steps since its last look -- so the looks' windows are disjoint and all in the phase. At look j every check
    must hold (docs/alpha_schedule.md, "Transitions"): ``loss_improvement_rate_below`` -- the upper bound
    ``I + t(look_level(j), dof)·se`` below δ (:func:`plateau_look`); ``not_rising`` -- no significant rise;
    ``gradient_stability >= min_gradient_stability`` unless stability is not applicable (``stability_applicable``
    False: every stint of an expert is one step); ``loss_r2 >= min_loss_r2`` and ``loss_cv <= max_loss_cv`` only
    where those are set. A NaN value fails its check. The last phase never ends.
    """

    def __init__(self, schedule: AlphaScheduleConfig, experts: tuple[str | None, ...], *,
                 stability_applicable: bool = True) -> None:
        self.schedule = schedule
        self.experts = tuple(experts)
        self.stability_applicable = stability_applicable
        self.window = schedule.resolved("window")
        self.state = {expert_key(e): ExpertPhase() for e in self.experts}
        self.history: list[dict[str, Any]] = []
        self.looks: list[dict[str, Any]] = []

    def phase_of(self, expert: str | None) -> int:
        return self.state[expert_key(expert)].phase

    def alpha_of(self, expert: str | None) -> float:
        return float(self.schedule.phases[self.phase_of(expert)].alpha)

    def look_due(self, expert: str | None, values: dict[str, float]) -> bool:
        """Whether this log step is a look for ``expert`` (see the class docstring)."""
        k, s = expert_key(expert), self.schedule
        st = self.state[k]
        steps = values[f"alpha/steps/{k}"]
        first = max(s.phases[st.phase].criterion("min_steps", s.preset), self.window)
        samples = values.get(f"alpha/loss_samples/{k}", math.nan)
        return (steps - st.phase_start >= first and samples >= s.resolved("min_samples")
                and (st.last_look < 0 or steps - st.last_look >= self.window))

    def checks(self, expert: str | None, values: dict[str, float], look: int = 1) -> list[Check]:
        """The checks of ``expert`` at look ``look`` (``signal = "train"``) or at a log step (``"validation"``)."""
        k, s = expert_key(expert), self.schedule
        st = self.state[k]
        phase = s.phases[st.phase]
        steps = values[f"alpha/steps/{k}"]
        steps_in_phase = steps - st.phase_start
        min_steps = phase.criterion("min_steps", s.preset)
        out = [Check("min_steps", steps_in_phase, min_steps, steps_in_phase >= min_steps)]
        delta = phase.criterion("loss_improvement_rate_below", s.preset)
        if s.signal == "validation":
            out.extend(self._validation_checks(st, delta))
        else:
            samples = values.get(f"alpha/loss_samples/{k}", math.nan)
            out.append(Check("min_samples", samples, s.resolved("min_samples"),
                             samples >= s.resolved("min_samples")))
            rate = values.get(f"alpha/loss_improvement_rate/{k}", math.nan)
            se = values.get(f"alpha/loss_improvement_rate_se/{k}", math.nan)
            dof = values.get(f"alpha/loss_improvement_rate_dof/{k}", math.nan)
            stopped, rising, bound = plateau_look(rate, se, dof, look, math.inf if delta is None else delta)
            if delta is not None:
                out.append(Check("loss_improvement_rate_below", float(bound), delta, bool(stopped)))
            out.append(Check("not_rising", float(rate), 0.0, not bool(rising)))
        stability = phase.criterion("min_gradient_stability", s.preset)
        if stability is not None and self.stability_applicable:
            value = values.get(f"alpha/gradient_stability/{k}", math.nan)
            out.append(Check("min_gradient_stability", value, stability, value >= stability))
        r2 = phase.criterion("min_loss_r2", s.preset)
        if r2 is not None:
            value = values.get(f"alpha/loss_r2/{k}", math.nan)
            out.append(Check("min_loss_r2", value, r2, value >= r2))
        cv = phase.criterion("max_loss_cv", s.preset)
        if cv is not None:
            value = values.get(f"alpha/loss_cv/{k}", math.nan)
            out.append(Check("max_loss_cv", value, cv, value <= cv))
        return out

    def _validation_checks(self, st: ExpertPhase, delta: float | None) -> list[Check]:
        """``signal = "validation"``: ``validation_plateau`` -- the last ``validation_patience`` rates between
        consecutive validations of this phase all below δ (value: the largest; NaN: too few validations yet);
        ``not_rising`` -- over those intervals together the loss did not rise faster than δ (value: that rate)."""
        patience = self.schedule.validation_patience
        kept = st.validations[-(patience + 1):]
        rates = validation_rates(kept)
        full = len(rates) == patience and not any(math.isnan(r) for r in rates)
        value = max(rates) if full else math.nan
        overall = validation_rates([kept[0], kept[-1]])[0] if full else math.nan
        threshold = math.inf if delta is None else delta
        return [Check("validation_plateau", value, threshold, math.isfinite(value) and value < threshold),
                Check("not_rising", overall, -threshold, math.isfinite(overall) and overall >= -threshold)]

    def _record_validations(self, step: int, values: dict[str, float]) -> None:
        """Keep each expert's validation loss of this phase (any MetricsLogged that carries it: validations on
        log steps and the validation's own events between them), at the expert's step count: the logged
        ``alpha/steps/<k>`` when this event carries it, else the last one seen plus the run steps since, shared
        among the experts (so rates are per 100 *expert* steps, as the training signal's)."""
        keep = self.schedule.validation_patience + 1
        for expert in self.experts:
            k = expert_key(expert)
            st = self.state[k]
            if f"alpha/steps/{k}" in values:
                st.anchor = [float(step), float(values[f"alpha/steps/{k}"])]
            value = values.get(validation_key(expert))
            if value is None or not math.isfinite(value) or st.phase >= len(self.schedule.phases) - 1:
                continue
            if st.anchor:
                at = st.anchor[1] + (step - st.anchor[0]) / len(self.experts)
            else:
                at = step / len(self.experts)
            if st.validations and st.validations[-1][0] >= at:
                continue  # one validation per step (a replayed or repeated record)
            st.validations = [*st.validations, [float(at), float(value)]][-keep:]

    def observe(self, step: int, values: dict[str, float]) -> list[dict[str, Any]]:
        """Transitions decided at log step ``step`` from its logged ``values`` (experts in a fixed order)."""
        decided: list[dict[str, Any]] = []
        self.looks = []
        train = self.schedule.signal == "train"
        if not train:
            self._record_validations(step, values)
        for expert in self.experts:
            k = expert_key(expert)
            st = self.state[k]
            if f"alpha/steps/{k}" not in values or st.phase >= len(self.schedule.phases) - 1:
                continue  # did not train in this interval, or already in the last phase
            steps = int(values[f"alpha/steps/{k}"])
            if train:
                if not self.look_due(expert, values):
                    continue
                st.looks, st.last_look, fresh = st.looks + 1, float(steps), True
            else:  # judged at every log step; a look (reported) once per new validation
                fresh = bool(st.validations) and st.validations[-1][0] > st.last_look
                if fresh:
                    st.looks, st.last_look = st.looks + 1, st.validations[-1][0]
            checks = self.checks(expert, values, st.looks)
            ok = {c.criterion: c.ok for c in checks}
            passed = all(ok.values())
            trend = "rising" if not ok["not_rising"] else "flat" if ok.get(
                "loss_improvement_rate_below", ok.get("validation_plateau", True)) else "falling"
            if fresh or passed:
                self.looks.append({"expert": expert, "look": st.looks, "trend": trend, "ended": passed,
                               "checks": {c.criterion: {"value": c.value, "threshold": c.threshold, "ok": c.ok}
                                              for c in checks}})
            if not passed:
                continue
            old, new = self.schedule.phases[st.phase], self.schedule.phases[st.phase + 1]
            statistics = {name: float(values.get(f"alpha/{name}/{k}", math.nan)) for name in STATISTICS}
            if st.validations:  # signal = "validation": the last validation loss of the phase
                statistics["validation_loss"] = st.validations[-1][1]
            transition = {
                "step": step, "expert": expert, "from_phase": old.name, "to_phase": new.name,
                "from_alpha": float(old.alpha), "to_alpha": float(new.alpha), "phase_index": st.phase + 1,
                "steps_in_phase": steps - st.phase_start, "transition": self.schedule.transition,
                "statistics": statistics,
                "checks": {c.criterion: {"value": c.value, "threshold": c.threshold} for c in checks},
            }
            st.phase, st.phase_start, st.looks, st.last_look, st.validations = st.phase + 1, steps, 0, -1.0, []
            self.history.append(transition)
            decided.append(transition)
        return decided

    def state_dict(self) -> dict[str, Any]:
        return {"experts": {k: attrs.asdict(v) for k, v in self.state.items()},
                "history": json.loads(json.dumps(self.history))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {k: ExpertPhase(**v) for k, v in state["experts"].items()}
        self.history = list(state["history"])


class AlphaController(Observer):
    """Attached by ``build_observers`` when ``lora.alpha_schedule.enabled``. A controller: it has the LoRA's alpha
    changed (a ``ctx.control.set_lora_alpha`` request, at a log step; it holds neither model nor optimizer), and
    it is critical -- a failure mid-decision must stop the run rather than leave the experts on diverging phases."""

    priority = Priority.CONTROLLER
    critical = True
    needs = (AlphaChangeable,)
    replayable = True  # the decisions come from MetricsLogged.values; without an adapter no alpha is changed
    emits = (AlphaChanged, AlphaHeld)

    def __init__(self, schedule: AlphaScheduleConfig, experts: tuple[str | None, ...],
                 metrics_path: Path | None = None, *, stability_applicable: bool = True) -> None:
        self.schedule = schedule
        self.policy = AlphaPolicy(schedule, experts, stability_applicable=stability_applicable)
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        self.window = schedule.resolved("window")
        self._bus: Any = None
        self._steps = {expert_key(e): 0 for e in experts}  # optimizer steps each expert trained (GradsReady)
        self._losses: dict[str, DeviceWindow] = {}
        self._stability: dict[str, DeviceWindow] = {}
        self._signs = {expert_key(e): SignAgreement() for e in experts}
        self._trained: set[str] = set()  # experts that trained since the last log step
        # the experts this process trains (ctx.adapter's, at RunStarted): with model.expert_groups its group's only;
        # None until then, and in a replay (no adapter): every expert
        self._held: set[str] | None = None
        self._logged_steps: dict[str, float] = {}  # alpha/steps/<k> at the last log step that carried it
        self._step_loss: torch.Tensor | None = None
        self._micro = 0

    def bind(self, bus: Any) -> None:
        self._bus = bus

    # -- device side, every step (no sync) ---------------------------------------------------------------------
    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        adapter = getattr(ctx, "adapter", None)
        if adapter is not None:
            self._held = {expert_key(e) for e in adapter.experts}
        if self.metrics_path is not None:
            cut_back(self.metrics_path, event.step)

    @on(ExpertSwitched)
    def on_expert_switched(self, event: ExpertSwitched, ctx) -> None:
        # sign agreement compares consecutive steps of one expert: the stint that ended has no successor
        self._signs[expert_key(event.previous)].reset()

    @on(StepStarted)
    def on_step_started(self, event: StepStarted, ctx) -> None:
        if event.accumulation_index == 1:
            self._step_loss, self._micro = None, 0  # an out-of-memory step left a partial sum behind

    @on(LossComputed)
    def on_loss_computed(self, event: LossComputed, ctx) -> None:
        loss = ctx.live.loss
        if loss is None:
            return
        loss = loss.detach().float()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        self._micro += 1

    @on(GradsReady)
    def on_grads_ready(self, event: GradsReady, ctx) -> None:
        if self._step_loss is None or ctx.adapter is None:
            return
        k = expert_key(event.expert)
        device = self._step_loss.device
        if k not in self._losses:
            self._losses[k] = DeviceWindow(self.window, device)
            self._stability[k] = DeviceWindow(self.window, device)
        self._losses[k].to(device)  # a resumed window comes from the checkpoint on the CPU: moved once
        self._stability[k].to(device)
        for other, signs in self._signs.items():
            if other != k:
                signs.reset()  # also after a resume at a stint's end, where no ExpertSwitched fires
        self._losses[k].push(self._step_loss / self._micro)
        self._step_loss = None
        grads = [p.grad for p in ctx.adapter.trainable_parameters(event.expert) if p.grad is not None]
        agreement = self._signs[k].update(grads)
        if agreement is not None:
            self._stability[k].push(agreement)
        self._steps[k] += 1
        self._trained.add(k)

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx) -> None:
        if not event.is_log_step:
            return
        metrics = ctx.metrics
        for k in sorted(self._trained):
            for name, value in loss_statistics(self._losses[k]).items():
                metrics.put(f"alpha/{name}/{k}", value)
            metrics.put(f"alpha/gradient_stability/{k}", window_mean(self._stability[k]))
            metrics.put(f"alpha/steps/{k}", float(self._steps[k]))
        self._trained.clear()
        for expert in self.policy.experts:
            k = expert_key(expert)
            st = self.policy.state[k]
            metrics.put(f"alpha/phase/{k}", float(st.phase))
            if self.holds(k):  # an expert another group trains: its group puts its step count
                metrics.put(f"alpha/steps_in_phase/{k}", float(self._steps[k] - st.phase_start))
            metrics.put(f"alpha/linear_alpha/{k}", self.policy.alpha_of(expert))
        metrics.put("alpha/phase", float(min(st.phase for st in self.policy.state.values())))

    def holds(self, k: str) -> bool:
        """Whether this process trains expert key ``k`` (every expert in one process; under
        ``model.expert_groups`` its group's)."""
        return self._held is None or k in self._held

    # -- host side, once per log interval ----------------------------------------------------------------------
    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx) -> None:
        for expert in self.policy.experts:
            k = expert_key(expert)
            if f"alpha/steps/{k}" in event.values:
                self._logged_steps[k] = float(event.values[f"alpha/steps/{k}"])
        before = {k: (st.phase, st.phase_start) for k, st in self.policy.state.items()}
        transitions = self.policy.observe(event.step, event.values)
        looks = {expert_key(x["expert"]): x for x in self.policy.looks}
        self._write_seed_metrics(event, before, looks)
        for k, x in looks.items():
            if x["trend"] != "rising":
                continue
            phase, start = before[k]
            rate = x["checks"]["not_rising"]["value"]
            se = float(event.values.get(f"alpha/loss_improvement_rate_se/{k}", math.nan))
            if self.schedule.signal == "validation":
                se = math.nan
            held = AlphaHeld(step=event.step, expert=x["expert"], phase=self.schedule.phases[phase].name,
                             phase_index=phase, steps_in_phase=int(event.values[f"alpha/steps/{k}"]) - start,
                             look=x["look"], rate=rate, se=se)
            if ctx is not None:
                log.info("alpha_held", step=event.step, expert=k, phase=held.phase, look=held.look,
                         reason=f"the loss is rising: {rate:.3g} per 100 steps (se {se:.2g})")
            if self._bus is not None:
                self._bus.emit(held)
        for t in transitions:
            if ctx is not None:  # replay: nobody applies the request (there is no model)
                if self.holds(expert_key(t["expert"])):  # expert groups: the ranks of the expert's group
                    ctx.control.set_lora_alpha(t["expert"], t["to_alpha"],
                                               preserve_output=t["transition"] == "preserve_output")
                stats = t["statistics"]
                log.info("alpha_changed", step=t["step"], expert=expert_key(t["expert"]),
                         phase=f"{t['from_phase']} -> {t['to_phase']}",
                         alpha=f"{t['from_alpha']:g} -> {t['to_alpha']:g}",
                         steps_in_phase=t["steps_in_phase"],
                         improvement_rate=f"{stats['loss_improvement_rate']:.3g} (se "
                                          f"{stats['loss_improvement_rate_se']:.2g})",
                         gradient_stability=round(stats["gradient_stability"], 3),
                         checks={name: c["value"] for name, c in t["checks"].items()})
            if self._bus is not None:
                self._bus.emit(AlphaChanged(**t))

    def _write_seed_metrics(self, event: MetricsLogged, before: dict[str, tuple[int, int]],
                            looks: dict[str, dict[str, Any]]) -> None:
        """The seed's JSONL fields: one line per expert evaluated at this log step (state before the decision),
        plus the look taken there, if any: ``look`` (its number in the phase), ``trend`` (``rising``: held;
        ``falling``; ``flat``) and ``plateau_bound`` (the rate's upper bound the plateau test compared with δ)."""
        if self.metrics_path is None:
            return
        lines = []
        for expert in self.policy.experts:
            k = expert_key(expert)
            if f"alpha/steps/{k}" not in event.values:
                continue
            phase, start = before[k]
            stats = {name: _finite(event.values.get(f"alpha/{name}/{k}")) for name in STATISTICS}
            samples = stats.pop("loss_samples")
            look = looks.get(k)
            bound = look["checks"].get("loss_improvement_rate_below", {}).get("value") if look else None
            lines.append({
                "step": event.step, "expert": expert, "phase": self.schedule.phases[phase].name, "phase_idx": phase,
                "steps_in_phase": int(event.values[f"alpha/steps/{k}"]) - start,
                "conv_alpha": None,  # Wan 2.2's LoRA has no conv layers
                "linear_alpha": float(self.schedule.phases[phase].alpha), **stats,
                "loss_samples": int(samples) if samples is not None else 0,
                "look": look["look"] if look else None, "trend": look["trend"] if look else None,
                "plateau_bound": _finite(bound),
            })
        if lines:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open_append(self.metrics_path, text=True) as f:  # never through a symbolic link
                f.writelines(json.dumps(line, allow_nan=False) + "\n" for line in lines)

    # -- checkpoint state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly: the policy, the step counts, the device windows and the previous
        step's gradient signs (live references; the checkpoint writer copies)."""
        return {
            "policy": self.policy.state_dict(),
            "steps": dict(self._steps),
            "trained_since_log": sorted(self._trained),
            "loss_windows": {k: w.state_dict() for k, w in self._losses.items()},
            "stability_windows": {k: w.state_dict() for k, w in self._stability.items()},
            "signs": {k: s.state_dict() for k, s in self._signs.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self._steps = {k: int(v) for k, v in state["steps"].items()}
        self._trained = set(state["trained_since_log"])
        for name, target in (("loss_windows", self._losses), ("stability_windows", self._stability)):
            target.clear()
            for k, saved in state[name].items():
                window = DeviceWindow(self.window, saved["values"].device)
                window.load_state_dict(saved)
                target[k] = window
        for k, saved in state["signs"].items():
            self._signs[k].load_state_dict(saved)

    def write_sidecars(self, directory: Path, stem: str) -> None:
        """``<stem>_alpha_scheduler.json``: the seed's file, readable without wantrain (phases, steps, the
        windows' values oldest first, the transition history). Resume reads the checkpoint's state, not this.
        Under ``model.expert_groups`` (written by rank 0) an expert another group trains has its phase and alpha,
        its step counts as of the last log step (``steps_as_of_log_step``: true) and no windows (they are in that
        group leader's state in the checkpoint)."""
        experts = {}
        for expert in self.policy.experts:
            k = expert_key(expert)
            st = self.policy.state[k]
            steps = self._steps[k] if self.holds(k) else int(self._logged_steps.get(k, st.phase_start))
            experts[k] = {
                "current_phase_idx": st.phase, "phase": self.schedule.phases[st.phase].name,
                "alpha": self.policy.alpha_of(expert), "total_steps": steps,
                "steps_in_phase": steps - st.phase_start,
                "losses": [_finite(v) for v in self._losses[k].host_values()] if k in self._losses else [],
                "grad_stability": ([_finite(v) for v in self._stability[k].host_values()]
                                   if k in self._stability else []),
            }
            if not self.holds(k):
                experts[k]["steps_as_of_log_step"] = True
        history = [{**t, "statistics": {n: _finite(v) for n, v in t["statistics"].items()},
                    "checks": {n: {key: _finite(v) for key, v in c.items()} for n, c in t.get("checks", {}).items()}}
                   for t in self.policy.history]
        payload = {"enabled": True, "transition": self.schedule.transition, "experts": experts,
                   "transition_history": history}
        path = Path(directory) / f"{stem}_alpha_scheduler.json"
        path.write_text(json.dumps(payload, indent=2, allow_nan=False), encoding="utf-8")


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
