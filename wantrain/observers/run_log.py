"""Logs the run's milestones (start, expert switches, saves, requests from ``wantrain ctl`` or the page,
out-of-memory, observer failures, end) with structlog.
Under ``wantrain replay`` a save is logged as ``recorded_lora_saved``: the paths are the recorded run's files.

Per-step numbers go to the metrics writers, not to the log.
"""

from __future__ import annotations

import structlog

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import (
    CheckpointSaved,
    ControlRequested,
    ExpertSwitched,
    ObserverFailed,
    OutOfMemory,
    RunEnded,
    RunStarted,
)

log = structlog.get_logger("wantrain.run")


class RunLog(Observer):
    priority = Priority.SINK
    replayable = True  # from MetricsLogged and the other events alone

    @on(RunStarted)
    def started(self, event: RunStarted, ctx) -> None:
        # one transformer (TI2V-5B) has no experts to name
        experts = {"experts": list(event.experts)} if any(event.experts) else {}
        log.info("run_started", run_dir=event.run_dir, total_steps=event.total_steps, start_step=event.step,
                 grad_accum=event.grad_accum, **experts)

    @on(ExpertSwitched)
    def switched(self, event: ExpertSwitched, ctx) -> None:
        log.info("expert_switched", step=event.step, previous=event.previous, expert=event.expert)

    @on(CheckpointSaved)
    def saved(self, event: CheckpointSaved, ctx) -> None:
        # replayed (no live model in the context): the files are the recorded run's, and the replay writes none
        name = "lora_saved" if ctx.adapter is not None else "recorded_lora_saved"
        log.info(name, step=event.step, final=event.final, reason=event.reason, paths=list(event.paths))

    @on(ControlRequested)
    def requested(self, event: ControlRequested, ctx) -> None:
        if event.refused is None:
            log.info("request", step=event.step, action=event.action, source=event.source)
        else:
            log.warning("request_refused", step=event.step, action=event.action, source=event.source,
                        reason=event.refused)

    @on(OutOfMemory)
    def out_of_memory(self, event: OutOfMemory, ctx) -> None:
        log.error("out_of_memory", step=event.step, phase=event.phase, expert=event.expert,
                  consecutive=event.consecutive, message=event.message,
                  action="batch skipped; the run stops after train.max_consecutive_oom in a row")

    @on(ObserverFailed)
    def observer_failed(self, event: ObserverFailed, ctx) -> None:
        log.warning("observer_disabled" if event.disabled else "observer_error", observer=event.observer,
                    event_type=event.event_type, error=event.error, failures=event.failures)

    @on(RunEnded)
    def ended(self, event: RunEnded, ctx) -> None:
        method = {"failed": log.error, "aborted": log.warning}.get(event.status, log.info)
        method("run_ended", step=event.step, status=event.status, reason=event.reason)
