"""Epoch settings resolved to optimizer steps from the data plan (``train.max_epochs``, ``train.save_every_epochs``,
``validation.every_epochs``, ``sample.every_epochs``), before anything is written: :func:`prepare` and
``wantrain check`` / ``wantrain schedule`` call :func:`resolve_epochs` right after the dataset is planned.

The run then trains on a config whose step keys hold the resolved numbers; the config the run directory keeps
(``config.toml``) is the user's, with the epoch keys. The arithmetic is ``wantrain.data.epochs``'.
"""

from __future__ import annotations

from typing import Any

import attrs

from wantrain.data.epochs import EpochSteps


def uses_epochs(cfg: Any) -> bool:
    return cfg.train.uses_epochs or cfg.validation.every_epochs is not None or cfg.sample.every_epochs is not None


def resolve_epochs(cfg: Any, data: Any) -> Any:
    """``cfg`` with every epoch key replaced by optimizer steps of ``data``'s plan (a ``TrainingData``, sharded as
    it will train); records the resolution in ``data.report.epochs`` (printed by ``wantrain check``). ``cfg`` as
    it is when no epoch key is set."""
    if not uses_epochs(cfg):
        return cfg
    t = cfg.train
    intervals = [t.save_every_epochs, cfg.validation.every_epochs, cfg.sample.every_epochs]
    plan = EpochSteps.of(data, max([t.max_epochs or 1, *(n for n in intervals if n)]), t.grad_accum)
    resolved: dict[str, Any] = {"steps_per_epoch": plan.steps_per_epoch, "micro_batches": list(plan.micro_batches),
                                "grad_accum": t.grad_accum}
    train = t
    if t.max_epochs is not None:
        steps = plan.steps_for(t.max_epochs)
        train = attrs.evolve(train, max_epochs=None, max_steps=steps)
        resolved["max_epochs"] = {"epochs": t.max_epochs, "steps": steps}
    if t.save_every_epochs is not None:
        every = plan.every(t.save_every_epochs)
        train = attrs.evolve(train, save_every_epochs=None, save_every=every)
        resolved["save_every_epochs"] = {"epochs": t.save_every_epochs, "steps": every}
    changes: dict[str, Any] = {"train": train}
    for section in ("validation", "sample"):
        sub = getattr(cfg, section)
        if sub.every_epochs is not None:
            every = plan.every(sub.every_epochs)
            changes[section] = attrs.evolve(sub, every_epochs=None, every=every)
            resolved[f"{section}.every_epochs"] = {"epochs": sub.every_epochs, "steps": every}
    data.report.epochs = resolved
    return attrs.evolve(cfg, **changes)
