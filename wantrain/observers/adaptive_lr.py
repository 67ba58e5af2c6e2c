"""The step size an adaptive optimizer chose for itself (Prodigy), logged at each log step.

Metrics (host floats put into ``ctx.metrics`` at ``OptimizerStepped`` of a log step):

* ``optimizer/effective_lr/<group>`` -- ``d * lr``: the optimizer's step-size estimate ``d`` after the step (a
  parameter-group key; ``d`` for Prodigy, shared by every group) times the LR the group used at that step
  (``OptimizerStepped.lrs``, after schedule and ``set_lr`` requests). For Prodigy this is the effective AdamW-like
  learning rate; ``train/lr`` alone is only its multiplier.
* ``optimizer/d`` -- the estimate itself (the first group's).

Prodigy keeps ``d`` as a Python float (it syncs the device inside its own step), so reading it here does not sync.
The run attaches this observer for types whose registry entry names an ``adaptive_lr`` key.
"""

from __future__ import annotations

from typing import Any

from wantrain.core.bus import Observer, on
from wantrain.core.events import OptimizerStepped


class AdaptiveLR(Observer):
    name = "adaptive_lr"

    def __init__(self, key: str = "d") -> None:
        self.key = key

    @on(OptimizerStepped)
    def record(self, event: OptimizerStepped, ctx: Any) -> None:
        if not event.is_log_step:
            return
        groups = ctx.optimizer.param_groups
        for group, name, lr in zip(groups, event.group_names, event.lrs, strict=True):
            d = group.get(self.key)
            if isinstance(d, int | float):
                ctx.metrics.put(f"optimizer/effective_lr/{name}", float(d) * lr)
        first = groups[0].get(self.key)
        if isinstance(first, int | float):
            ctx.metrics.put(f"optimizer/{self.key}", float(first))
