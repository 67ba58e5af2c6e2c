"""The ``[lr_finder]`` table: the learning-rate range test (docs/lr_finder.md).

``wantrain run CONFIG --lr-finder`` sets ``enabled = true``; the other flags set the keys of the same names. Checked
when the config is loaded (one line naming the key): a start LR not below the end LR, a burn-in as long as the sweep;
a run id too long for the ``__lr_finder`` suffix (:func:`lr_finder_problems`, asked by ``app.preflight``). Warned
about at the same time: ``mode = "linear"`` over more than a decade.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from wantrain.core.config import above, at_least, section, setting
from wantrain.core.errors import ConfigError
from wantrain.core.problems import Problem, Rule
from wantrain.core.rundir import SAFE_NAME_RULE, is_safe_name

SUGGESTION_METHODS = ("valley", "steepest", "minimum")
RUN_ID_SUFFIX = "lr_finder"  # the sweep's run directory: <time>__<run_id>__lr_finder
NAME_MAX = max(n for n in range(1, 1000) if is_safe_name("a" * n))  # core.rundir's length limit (100)


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
    noise: Literal["probe", "stratified", "random", "fixed"] = setting(
        "probe", doc="What makes the losses of different LRs comparable: `probe` trains with the normal random draws "
        "and measures each LR on a fixed probe (`probe_clips` clips x `probe_timesteps` timestep quantiles, noise "
        "fixed for the whole sweep, no grad); the others measure the training loss: `stratified` spreads the "
        "timestep quantiles evenly over the sweep (fresh noise), `random` draws as training does, `fixed` gives every "
        "LR the first LR's timesteps and noise (it trains on the draws it measures: biased low, docs/lr_finder.md).",
    )
    probe_clips: int = setting(
        2, doc="`noise = \"probe\"`: the first N training clips (folder order) the probe measures on.",
        range=at_least(1),
    )
    probe_timesteps: int = setting(
        4, doc="`noise = \"probe\"`: timesteps per clip, at the quantiles (k + 0.5) / N of the swept expert's "
        "timestep distribution. Probe cost per LR: `probe_clips x probe_timesteps` forward passes without grad.",
        range=at_least(1),
    )
    smoothing: float = setting(
        0.9, doc="Beta of the bias-corrected exponential moving average of the rung losses drawn on the chart and in "
        "the CSV (the suggestions read a running median; 0 = no smoothing).",
        range=at_least(0.0),
    )
    diverge_factor: float = setting(
        4.0, doc="Stop an expert's sweep when the median of its last 5 losses exceeds this multiple of the lowest "
        "such median (a sustained rise: one or two outliers do not stop it).",
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
        if self.mode == "linear" and self.end_lr > 10 * self.start_lr:
            logging.getLogger("wantrain.lr_finder").warning(
                f"lr_finder.mode = 'linear' from {self.start_lr:g} to {self.end_lr:g} spans "
                f"{math.log10(self.end_lr / self.start_lr):.1f} decades: the decades below the top one get under "
                "10 % of the LRs together (use mode = 'exp', or a range within one decade)")

    @property
    def active(self) -> bool:
        return self.enabled or self.then_train


LR_FINDER_RULES = (
    LR_FINDER_RUN_ID := Rule("lr-finder-run-id", ("run.run_id", "lr_finder.enabled"),
                             "a run id too long for the sweep's suffix"),
)


def lr_finder_problems(cfg: Any) -> list[Problem]:
    """The LR finder (``lr_finder.enabled`` / ``then_train`` or ``--lr-finder``) against the run config: its
    run directory's suffix must fit the run id. (With ``model.expert_groups`` the groups sweep their experts side by
    side: ``wantrain.app.lr_finder``.)"""
    if not cfg.lr_finder.active:
        return []
    out = []
    run_id = cfg.run.run_id
    if run_id is not None and is_safe_name(run_id) and not is_safe_name(f"{run_id}__{RUN_ID_SUFFIX}"):
        room = NAME_MAX - len(f"__{RUN_ID_SUFFIX}")
        out.append(LR_FINDER_RUN_ID.problem(
            f"run.run_id is {len(run_id)} characters: with the LR finder's '__{RUN_ID_SUFFIX}' suffix the run "
            f"directory name breaks the rule ({SAFE_NAME_RULE}); use at most {room} characters"))
    return out
