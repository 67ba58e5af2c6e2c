"""Learning-rate schedules (docs/schedulers.md).

The loop calls :meth:`Scheduler.step` once per optimizer step, after ``optimizer.step()`` — never per
micro-batch, so gradient accumulation does not change the schedule. The schedule runs on the global optimizer
step and applies to every parameter group at once: with two experts, the ``high_noise`` and ``low_noise`` groups
follow the same curve, each scaled from its own base LR.
"""

from __future__ import annotations

from typing import Any, Protocol

from wantrain.core.errors import ConfigError
from wantrain.core.problems import Problem, Rule
from wantrain.schedulers.closed_form import ClosedFormScheduler, lr_at
from wantrain.schedulers.config import SchedulerConfig, warmup_steps_for

__all__ = ["Scheduler", "SchedulerConfig", "build_scheduler", "check_scheduler", "lr_at", "warmup_steps_for"]


class Scheduler(Protocol):
    """What the training core uses. Construction sets each group's LR to ``lr(0)``, the LR of the first
    optimizer step; after ``k`` calls of :meth:`step` the groups hold ``lr(k)``."""

    def step(self) -> None:
        """One optimizer step has been taken."""

    def state_dict(self) -> dict[str, Any]:
        """Resume state; JSON-safe for the built-in types."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state and set the groups' LR to that of the saved step."""

    def get_last_lr(self) -> list[float]:
        """Current LR of each parameter group, in the optimizer's group order."""


def check_scheduler(cfg: SchedulerConfig, total_steps: int) -> None:
    """Check that the configured schedule applies to a run of ``total_steps`` optimizer steps, without an
    optimizer (the run assembly calls it before anything is created).

    Raises the ``ConfigError`` (one line) that :func:`build_scheduler` would raise for this config and length.
    What does not depend on the length (types, keys, an external class and its arguments) was checked when the
    config was loaded; what does is the warmup (:func:`warmup_steps_for`).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")  # train.max_steps is >= 1: a bug
    if cfg.type != "external":
        warmup_steps_for(cfg, total_steps)


SCHEDULER_RULES = (
    WARMUP_FITS := Rule("warmup-fits-run", ("lr_scheduler.warmup_steps", "train.max_steps"),
                        "an integer warmup as long as the run"),
)


def scheduler_problems(cfg: SchedulerConfig, total_steps: int) -> list[Problem]:
    """What :func:`check_scheduler` refuses, as problems (``app.preflight`` asks it with the others)."""
    try:
        check_scheduler(cfg, total_steps)
    except ConfigError as exc:
        return [WARMUP_FITS.problem(str(exc))]
    return []


def build_scheduler(cfg: SchedulerConfig, optimizer: Any, *, total_steps: int) -> Scheduler:
    """Bind the configured schedule to ``optimizer`` for a run of ``total_steps`` optimizer steps.

    Each group's base LR is its ``initial_lr`` (or ``lr``) at this call. Raises ``ConfigError`` (one line) when
    the config cannot apply to this run (a warmup as long as the run, an external class that rejects its
    arguments); :func:`check_scheduler` raises the same without an optimizer.
    """
    check_scheduler(cfg, total_steps)
    if cfg.type == "external":
        from wantrain.schedulers.external import ExternalScheduler

        return ExternalScheduler(
            cfg.class_path, cfg.external_arguments(), optimizer, allow_external_code=cfg.allow_external_code
        )
    return ClosedFormScheduler(cfg, optimizer, total_steps=total_steps)
