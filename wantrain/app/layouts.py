"""What the several-GPU layouts cannot run with, read from the whole config (docs/distributed.md, "What composes").

:func:`problems` is the layouts' one list of config-only refusals that span sections (the model's own keys are
refused by ``models.wan22.config``; what depends on the launch's size by ``app.preflight.check_parallel``): each
entry is one line naming the pair, why it fails and what would run. ``RunConfig`` refuses the first when the config
is read, so ``wantrain check`` and ``wantrain run`` stop before anything loads or a run directory exists.
"""

from __future__ import annotations

from typing import Any

FSDP = "model.parallel = 'fsdp'"

FSDP_OPTIMIZERS = {
    "adamw8bit": "bitsandbytes' 8-bit AdamW steps plain tensors and has no path for the sharded (DTensor) LoRA",
    "adafactor": "transformers' Adafactor mixes its plain-tensor factored moments with the sharded (DTensor) "
                 "LoRA in one expression",
}
"""Optimizers that cannot step a LoRA that FSDP2 holds as ``DTensor`` shards, and why (each crashed at step 1)."""


def problems(cfg: Any) -> list[str]:
    """Every pair of ``cfg`` that a several-GPU layout cannot run, one line each (empty: none)."""
    found = []
    if cfg.model.parallel == "fsdp":
        if cfg.lora.type == "dora":
            found.append("lora.type = 'dora' reads the base weights outside their forward pass, which "
                         f"{FSDP} holds sharded there; use another lora.type or parallel = 'dp'")
        why = FSDP_OPTIMIZERS.get(cfg.optimizer.type)
        if why is not None:
            found.append(f"optimizer.type = '{cfg.optimizer.type}' does not run with {FSDP} ({why}); use "
                         "optimizer.type = 'adamw' or set model.parallel = 'dp'")
        if cfg.lora.schedule_enabled:
            found.append(f"lora.alpha_schedule does not run with {FSDP} yet (the controller's statistics read the "
                         "whole LoRA's values, which FSDP holds as shards on each rank); turn the schedule off "
                         "or set model.parallel = 'dp'")
    return found
