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


def idle_experts(cfg: Any) -> list[str]:
    """The trained experts that get no optimizer step in the run's steps ``1..train.max_steps`` (a resumed run
    keeps the step numbering of its checkpoint, so the count is the same however many sessions the run takes):
    with two experts, step ``s`` trains ``experts[(s - 1) // switch_every % 2]``
    (``Wan22Adapter.expert_for_step``), so the second one needs more than ``switch_every`` steps."""
    experts = [e for e in cfg.model.trained_experts if e is not None]
    every = cfg.model.switch_every
    return [e for i, e in enumerate(experts) if len(experts) > 1 and i * every >= cfg.train.max_steps]


def check_every_expert_trains(cfg: Any, *, user_cfg: Any = None) -> str | None:
    """Refuse a run whose length came from ``train.max_epochs`` (``user_cfg``: the config as the user wrote it,
    before :func:`resolve_epochs`) when an expert would get no optimizer step and be exported untrained (all-zero
    B matrices): nobody means that, and the step count was not theirs to see. With ``train.max_steps`` given (a
    smoke run may mean it) the same finding is returned as one warning line for the caller to log or print;
    ``None`` when every expert trains or the run is only the LR range test (it trains each expert itself)."""
    if cfg.lr_finder.active and not cfg.lr_finder.then_train:
        return None
    idle = idle_experts(cfg)
    if not idle:
        return None
    steps, every = cfg.train.max_steps, cfg.model.switch_every
    user_epochs = getattr(getattr(user_cfg, "train", None), "max_epochs", None)
    length = (f"train.max_epochs = {user_epochs} is {steps} optimizer steps" if user_epochs is not None
              else f"train.max_steps = {steps}")
    fix = (f"set model.switch_every <= {max(1, steps // 2)} (both experts share the steps), train longer, or "
           f"model.experts = '{cfg.model.trained_experts[0]}' to train one expert")
    line = (f"{length} with model.switch_every = {every}: the {' and '.join(idle)} expert gets no optimizer step "
            f"and its LoRA would be saved untrained (all-zero); {fix}")
    if user_epochs is not None:
        from wantrain.core.errors import ConfigError

        raise ConfigError(line)
    return line
