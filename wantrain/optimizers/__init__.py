"""Optimizers (docs/optimizers.md): ``[optimizer] type = "adamw" | "adamw8bit" | "prodigy" | "adafactor" |
"adamw_schedulefree" | "external"``.

:class:`OptimizerConfig` checks the table when the config is loaded; :func:`check_optimizer` tries one step of the
configured class on the training device in ``prepare()`` (so a backend that cannot run there is one line before
the run directory exists); :func:`build_optimizer` builds it over the adapter's parameter groups for the run.

What the rest of the run relies on (each type's path is in docs/optimizers.md):

* ``optimizer.group_state_keys`` -- parameter-group keys that are optimizer state (Prodigy's ``d``, schedule-free's
  ``k``/``weight_sum``/``train_mode``): the core restores them from a checkpoint instead of the config.
* ``optimizer.train()`` / ``optimizer.eval()`` (schedule-free) -- the core switches to eval while it saves.
* ``optimizer._step_supports_amp_scaling`` (fused AdamW) -- the core's non-finite guard skips a step on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from wantrain.core.errors import UserError
from wantrain.optimizers.config import OptimizerConfig
from wantrain.optimizers.registry import EXTERNAL, TYPE_NAMES, TYPES, OptimizerType

__all__ = ["TYPES", "TYPE_NAMES", "OptimizerConfig", "OptimizerType", "build_optimizer", "check_optimizer"]

# bitsandbytes' 8-bit state starts at this many elements per tensor (its min_8bit_size default); the device check
# uses a tensor this large so that it exercises the quantized kernels.
_PROBE_NUMEL = 4096


def _device_arguments(cfg: OptimizerConfig, device: torch.device) -> dict[str, Any]:
    if cfg.type == "adamw" and "fused" not in cfg.arguments and "foreach" not in cfg.arguments:
        # fused kernels exist for CPU and CUDA; they also take found_inf, so a non-finite step is skipped on the
        # device without a sync
        fused = device.type in ("cpu", "cuda")
        return {"fused": fused, "foreach": None if fused else True}
    return {}


def build_optimizer(cfg: OptimizerConfig, param_groups: list[dict[str, Any]], device: torch.device
                    ) -> torch.optim.Optimizer:
    """The configured optimizer over ``param_groups`` (each with ``params``, ``lr`` and ``name``; the groups' own
    LRs win over ``cfg.lr``). Schedule-free optimizers are returned in train mode."""
    cls = cfg.optimizer_class()
    optimizer = cls(param_groups, **{**cfg.keyword_arguments(), **_device_arguments(cfg, device)})
    spec = TYPES.get(cfg.type)
    optimizer.group_state_keys = spec.group_state_keys if spec is not None else ()  # type: ignore[attr-defined]
    if spec is not None:  # external classes: wantrain.core.optim_state knows torch's Adam/AdamW/SGD by class
        optimizer.state_kind = spec.state_kind  # type: ignore[attr-defined]
    return optimizer


def check_optimizer(cfg: OptimizerConfig, device: torch.device) -> None:
    """One step of the configured optimizer on a throwaway tensor on ``device``; a backend that cannot run there
    (bitsandbytes without support for the device) raises :class:`UserError` with one line."""
    probe = torch.zeros(_PROBE_NUMEL, device=device, requires_grad=True)
    try:
        optimizer = build_optimizer(cfg, [{"params": [probe], "lr": cfg.lr, "name": "probe"}], device)
        if callable(getattr(optimizer, "train", None)):
            optimizer.train()
        probe.grad = torch.full_like(probe, 1e-3)
        optimizer.step()
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError, AttributeError) as exc:
        what = cfg.class_path if cfg.type == EXTERNAL else f"optimizer.type = {cfg.type!r}"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        hint = "; use a CUDA device or type = 'adamw'" if cfg.type == "adamw8bit" else ""
        raise UserError(f"{what} cannot step on device {device.type} ({type(exc).__name__}: {first}){hint}") from None
