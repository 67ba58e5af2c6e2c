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
Replay: :class:`AlphaPolicy` is a pure function of ``MetricsLogged.values`` and its own state, so feeding a
recorded run's MetricsLogged events to a fresh policy (or a fresh controller without an adapter) reproduces its
AlphaChanged events exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
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

STATISTICS = ("loss_slope", "loss_r2", "loss_cv", "loss_improvement_rate", "loss_improvement_rate_se", "loss_samples",
              "gradient_stability")


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


def expert_key(expert: str | None) -> str:
    return expert or "lora"


PLATEAU_Z = 1.645
"""The plateau test's one-sided normal quantile (95 % per bound): the 90 % interval I ± 1.645·se(I) of the loss's
improvement rate must lie inside (-δ, δ)."""


@attrs.define
class ExpertPhase:
    """Where one expert stands: its phase index, its step count (``alpha/steps/<k>``) when that phase began, and
    the plateau tests of this phase so far as ``[steps, passed]`` pairs (only the last window's worth is kept);
    with ``signal = "validation"`` the validations of this phase as ``[run step, validation loss]`` pairs (the last
    ``validation_patience + 1`` kept)."""

    phase: int = 0
    phase_start: int = 0
    tests: list[list[float]] = attrs.field(factory=list)
    validations: list[list[float]] = attrs.field(factory=list)


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
    """The relative decrease per 100 run steps between consecutive validations ``[step, loss]``:
    ``r_j = 100·(v_{j-1} - v_j) / (|v_{j-1}|·(s_j - s_{j-1}))`` (NaN where undefined)."""
    out = []
    for (s0, v0), (s1, v1) in zip(validations, validations[1:]):
        ok = s1 > s0 and v0 != 0 and math.isfinite(v0) and math.isfinite(v1)
        out.append(100.0 * (v0 - v1) / (abs(v0) * (s1 - s0)) if ok else math.nan)
    return out


def plateau_holds(rate: float, se: float, delta: float) -> bool:
    """Whether the loss is flat with confidence: ``rate ± PLATEAU_Z·se`` inside ``(-delta, delta)`` (NaN: no)."""
    return (math.isfinite(rate) and math.isfinite(se)
            and rate + PLATEAU_Z * se < delta and rate - PLATEAU_Z * se > -delta)


class AlphaPolicy:
    """The decisions, on host values only: no tensors, no clock, no randomness.

    :meth:`observe` takes a log step's ``MetricsLogged.values`` and returns the transitions it decides (updating
    the phase state). Per expert, every check must hold (docs/alpha_schedule.md, "Transitions"):
    ``steps_in_phase >= min_steps``; ``loss_samples >= min_samples``; the plateau test -- the 90 % interval of
    ``loss_improvement_rate`` (``± PLATEAU_Z · loss_improvement_rate_se``) inside ``(-δ, δ)``, δ =
    ``loss_improvement_rate_below`` -- on this window and on the ``plateau_windows - 1`` windows before it
    (``window``, 2x``window``, ... steps earlier; disjoint, all in this phase, each with ``min_samples``);
    ``gradient_stability >= min_gradient_stability`` unless stability is not
    applicable (``stability_applicable`` False: every stint of an expert is one step); ``loss_r2 >= min_loss_r2``
    and ``loss_cv <= max_loss_cv`` only where those are set (the presets leave them advisory). A NaN value fails
    its check. The last phase never ends.
    """

    def __init__(self, schedule: AlphaScheduleConfig, experts: tuple[str | None, ...], *,
                 stability_applicable: bool = True) -> None:
        self.schedule = schedule
        self.experts = tuple(experts)
        self.stability_applicable = stability_applicable
        self.window = schedule.resolved("window")
        self.state = {expert_key(e): ExpertPhase() for e in self.experts}
        self.history: list[dict[str, Any]] = []

    def phase_of(self, expert: str | None) -> int:
        return self.state[expert_key(expert)].phase

    def alpha_of(self, expert: str | None) -> float:
        return float(self.schedule.phases[self.phase_of(expert)].alpha)

    def _earlier_test(self, st: ExpertPhase, steps: float, windows: int = 1) -> list[float] | None:
        """The newest plateau test of this phase at least ``windows`` windows before ``steps`` (None: none)."""
        earlier = [t for t in st.tests if t[0] <= steps - windows * self.window]
        return earlier[-1] if earlier else None

    def checks(self, expert: str | None, values: dict[str, float]) -> list[Check]:
        k, s = expert_key(expert), self.schedule
        st = self.state[k]
        phase = s.phases[st.phase]
        steps = values[f"alpha/steps/{k}"]
        steps_in_phase = steps - st.phase_start
        min_steps = phase.criterion("min_steps", s.preset)
        out = [Check("min_steps", steps_in_phase, min_steps, steps_in_phase >= min_steps)]
        delta = phase.criterion("loss_improvement_rate_below", s.preset)
        if s.signal == "validation":
            out.append(self._validation_check(st, delta))
        else:
            samples = values.get(f"alpha/loss_samples/{k}", math.nan)
            out.append(Check("min_samples", samples, s.resolved("min_samples"),
                             samples >= s.resolved("min_samples")))
        if delta is not None and s.signal == "train":
            rate = values.get(f"alpha/loss_improvement_rate/{k}", math.nan)
            se = values.get(f"alpha/loss_improvement_rate_se/{k}", math.nan)
            out.append(Check("loss_improvement_rate_below", rate, delta, plateau_holds(rate, se, delta)))
            for j in range(1, s.plateau_windows):  # the disjoint windows before this one, each must have passed
                earlier = self._earlier_test(st, steps, j)
                out.append(Check("earlier_window" if j == 1 else f"earlier_window_{j}",
                                 math.nan if earlier is None else earlier[0], steps - j * self.window,
                                 earlier is not None and bool(earlier[1])))
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

    def _validation_check(self, st: ExpertPhase, delta: float | None) -> Check:
        """``signal = "validation"``: the last ``validation_patience`` rates between consecutive validations of
        this phase all inside (-δ, δ); the value is the largest |rate| of them (NaN: too few validations yet)."""
        patience = self.schedule.validation_patience
        rates = validation_rates(st.validations)[-patience:]
        value = max((abs(r) for r in rates), default=math.nan) if len(rates) == patience else math.nan
        if any(math.isnan(r) for r in rates):
            value = math.nan
        threshold = math.inf if delta is None else delta
        return Check("validation_plateau", value, threshold, math.isfinite(value) and value < threshold)

    def _record_validations(self, step: int, values: dict[str, float]) -> None:
        """Keep each expert's validation loss of this phase (any MetricsLogged that carries it: validations on
        log steps and the validation's own events between them)."""
        keep = self.schedule.validation_patience + 1
        for expert in self.experts:
            st = self.state[expert_key(expert)]
            value = values.get(validation_key(expert))
            if value is None or not math.isfinite(value) or st.phase >= len(self.schedule.phases) - 1:
                continue
            if st.validations and st.validations[-1][0] >= step:
                continue  # one validation per step (a replayed or repeated record)
            st.validations = [*st.validations, [float(step), float(value)]][-keep:]

    def observe(self, step: int, values: dict[str, float]) -> list[dict[str, Any]]:
        """Transitions decided at log step ``step`` from its logged ``values`` (experts in a fixed order)."""
        decided = []
        if self.schedule.signal == "validation":
            self._record_validations(step, values)
        for expert in self.experts:
            k = expert_key(expert)
            st = self.state[k]
            if f"alpha/steps/{k}" not in values or st.phase >= len(self.schedule.phases) - 1:
                continue  # did not train in this interval, or already in the last phase
            checks = self.checks(expert, values)
            steps = int(values[f"alpha/steps/{k}"])
            ok = {c.criterion: c.ok for c in checks}
            if "loss_improvement_rate_below" in ok:  # this window's plateau test, for the test one window later
                passed = ok["loss_improvement_rate_below"] and ok["min_samples"]
                st.tests.append([float(steps), 1.0 if passed else 0.0])
                oldest = self._earlier_test(st, steps, max(self.schedule.plateau_windows - 1, 1))
                st.tests = [t for t in st.tests if oldest is None or t[0] >= oldest[0]]
            if not all(c.ok for c in checks):
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
            st.phase, st.phase_start, st.tests, st.validations = st.phase + 1, steps, [], []
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
    emits = (AlphaChanged,)

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
        self._step_loss: torch.Tensor | None = None
        self._micro = 0

    def bind(self, bus: Any) -> None:
        self._bus = bus

    # -- device side, every step (no sync) ---------------------------------------------------------------------
    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
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
            metrics.put(f"alpha/steps_in_phase/{k}", float(self._steps[k] - st.phase_start))
            metrics.put(f"alpha/linear_alpha/{k}", self.policy.alpha_of(expert))
        metrics.put("alpha/phase", float(min(st.phase for st in self.policy.state.values())))

    # -- host side, once per log interval ----------------------------------------------------------------------
    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx) -> None:
        before = {k: (st.phase, st.phase_start) for k, st in self.policy.state.items()}
        transitions = self.policy.observe(event.step, event.values)
        self._write_seed_metrics(event, before)
        for t in transitions:
            if ctx is not None:  # replay: nobody applies the request (there is no model)
                ctx.control.set_lora_alpha(t["expert"], t["to_alpha"],
                                           preserve_output=t["transition"] == "preserve_output")
                stats = t["statistics"]
                log.info("alpha_changed", step=t["step"], expert=expert_key(t["expert"]),
                         phase=f"{t['from_phase']} -> {t['to_phase']}",
                         alpha=f"{t['from_alpha']:g} -> {t['to_alpha']:g}",
                         steps_in_phase=t["steps_in_phase"],
                         improvement_rate=f"{stats['loss_improvement_rate']:.3g} +- "
                                          f"{PLATEAU_Z * stats['loss_improvement_rate_se']:.2g}",
                         gradient_stability=round(stats["gradient_stability"], 3),
                         checks={name: c["value"] for name, c in t["checks"].items()})
            if self._bus is not None:
                self._bus.emit(AlphaChanged(**t))

    def _write_seed_metrics(self, event: MetricsLogged, before: dict[str, tuple[int, int]]) -> None:
        """The seed's JSONL fields: one line per expert evaluated at this log step (state before the decision)."""
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
            lines.append({
                "step": event.step, "expert": expert, "phase": self.schedule.phases[phase].name, "phase_idx": phase,
                "steps_in_phase": int(event.values[f"alpha/steps/{k}"]) - start,
                "conv_alpha": None,  # Wan 2.2's LoRA has no conv layers
                "linear_alpha": float(self.schedule.phases[phase].alpha), **stats,
                "loss_samples": int(samples) if samples is not None else 0,
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
        windows' values oldest first, the transition history). Resume reads the checkpoint's state, not this."""
        experts = {}
        for expert in self.policy.experts:
            k = expert_key(expert)
            st = self.policy.state[k]
            experts[k] = {
                "current_phase_idx": st.phase, "phase": self.schedule.phases[st.phase].name,
                "alpha": self.policy.alpha_of(expert), "total_steps": self._steps[k],
                "steps_in_phase": self._steps[k] - st.phase_start,
                "losses": [_finite(v) for v in self._losses[k].host_values()] if k in self._losses else [],
                "grad_stability": ([_finite(v) for v in self._stability[k].host_values()]
                                   if k in self._stability else []),
            }
        history = [{**t, "statistics": {n: _finite(v) for n, v in t["statistics"].items()},
                    "checks": {n: {key: _finite(v) for key, v in c.items()} for n, c in t.get("checks", {}).items()}}
                   for t in self.policy.history]
        payload = {"enabled": True, "transition": self.schedule.transition, "experts": experts,
                   "transition_history": history}
        path = Path(directory) / f"{stem}_alpha_scheduler.json"
        path.write_text(json.dumps(payload, indent=2, allow_nan=False), encoding="utf-8")


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
