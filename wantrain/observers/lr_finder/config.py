"""The ``[lr_finder]`` table: the learning-rate range test (docs/lr_finder.md).

``wantrain run CONFIG --lr-finder`` sets ``enabled = true``; the other flags set the keys of the same names. Checked
when the config is loaded (one line naming the key): a start LR not below the end LR, a burn-in as long as the sweep.
"""

from __future__ import annotations

from typing import Literal

from wantrain.core.config import above, at_least, section, setting
from wantrain.core.errors import ConfigError

SUGGESTION_METHODS = ("valley", "steepest", "minimum")


@section
class LrFinderConfig:
    """The learning-rate range test: sweep the LR from `start_lr` to `end_lr` and suggest one (docs/lr_finder.md)."""

    enabled: bool = setting(
        False, doc="Run the range test instead of training (`--lr-finder`): a run directory `<time>__lr_finder`, no "
        "LoRA and no checkpoint written, then exit.",
    )
    then_train: bool = setting(
        False, doc="After the test, restore the LoRA, optimizer, scheduler, random streams and data position as they "
        "were before it and train normally with the suggested LR, in a normal run directory "
        "(`--lr-finder-then-train`; implies `enabled`).",
    )
    steps: int = setting(
        100, doc="Learning rates tested per expert (the sweep's rungs; both end points included).", range=at_least(5),
    )
    start_lr: float = setting(1e-7, doc="First learning rate of the sweep.", range=above(0.0))
    end_lr: float = setting(10.0, doc="Last learning rate of the sweep.", range=above(0.0))
    mode: Literal["exp", "linear"] = setting(
        "exp", doc="`exp`: LRs evenly spaced in log(LR); `linear`: evenly spaced in LR (for a range within one "
        "decade).",
    )
    steps_per_lr: int = setting(
        1, doc="Optimizer steps at each LR; the rung's loss is their mean (each step has `train.grad_accum` "
        "micro-batches).", range=at_least(1),
    )
    noise: Literal["fixed", "stratified", "random"] = setting(
        "fixed", doc="What makes the losses of different LRs comparable: `fixed` gives every rung the same timesteps "
        "and noise; `stratified` spreads the timestep quantiles evenly over the sweep (fresh noise); `random` draws "
        "as training does.",
    )
    smoothing: float = setting(
        0.9, doc="Beta of the bias-corrected exponential moving average of the rung losses (0 = no smoothing).",
        range=at_least(0.0),
    )
    diverge_factor: float = setting(
        4.0, doc="Stop an expert's sweep when its smoothed loss exceeds this multiple of its best smoothed loss.",
        range=above(1.0),
    )
    burn_in: int = setting(
        10, doc="Rungs before the divergence rule applies (a non-finite loss stops at once).", range=at_least(0),
    )
    suggestion: Literal["valley", "steepest", "minimum"] = setting(
        "valley", doc="The method whose LR is *the* suggestion (all three are reported): `valley`, `steepest` "
        "(steepest descent in log LR) or `minimum` (LR of the lowest loss / 10).",
    )

    def __attrs_post_init__(self) -> None:
        if self.smoothing >= 1.0:
            raise ConfigError(f"lr_finder.smoothing = {self.smoothing:g} must be below 1 (0.9 is a good value)")
        if self.start_lr >= self.end_lr:
            raise ConfigError(f"lr_finder.start_lr = {self.start_lr:g} must be below lr_finder.end_lr = "
                              f"{self.end_lr:g}")
        if self.burn_in >= self.steps:
            raise ConfigError(f"lr_finder.burn_in = {self.burn_in} must be below lr_finder.steps = {self.steps}")

    @property
    def active(self) -> bool:
        return self.enabled or self.then_train
