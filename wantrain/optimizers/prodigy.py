"""Prodigy for wantrain's per-expert parameter groups.

prodigyopt's ``Prodigy`` refuses groups whose LRs differ (except 0), but wantrain gives each expert its own group
(``model.lr_high_noise`` / ``model.lr_low_noise``, one-step ``set_lr`` requests) and steps one expert at a time.
:class:`ExpertProdigy` sets the LR of groups without gradients to 0 for the duration of ``step()`` (they are not
updated anyway) and restores it, so the active expert's LR scales the shared step-size estimate ``d``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prodigyopt import Prodigy


class ExpertProdigy(Prodigy):
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        idle = [g for g in self.param_groups if all(p.grad is None for p in g["params"])]
        if len(idle) == len(self.param_groups):
            idle = []  # nothing to update; leave the groups as they are
        saved = [g["lr"] for g in idle]
        for group in idle:
            group["lr"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(idle, saved, strict=True):
                group["lr"] = lr
