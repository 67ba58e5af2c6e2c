"""What the several-GPU layouts cannot run with, read from the whole config (docs/distributed.md, "What composes").

:func:`problems` is the layouts' one list of config-only refusals that span sections (the model's own keys are
refused by ``models.wan22.config``; what depends on the launch's size by ``app.launch.check_parallel``): each
entry is one line naming the pair, why it fails and what would run. ``RunConfig`` refuses them when the config
is read, so ``wantrain check`` and ``wantrain run`` stop before anything loads or a run directory exists.
"""

from __future__ import annotations

from typing import Any

from wantrain.core.problems import Problem, Rule

FSDP = "model.parallel = 'fsdp'"

FSDP_OPTIMIZERS = {
    "adamw8bit": "bitsandbytes' 8-bit AdamW steps plain tensors and has no path for the sharded (DTensor) LoRA",
    "adafactor": "transformers' Adafactor mixes its plain-tensor factored moments with the sharded (DTensor) "
                 "LoRA in one expression",
}
"""Optimizers that cannot step a LoRA that FSDP2 holds as ``DTensor`` shards, and why (each crashed at step 1)."""


LAYOUT_RULES = (
    FSDP_OPTIMIZER := Rule("fsdp-optimizer", ("model.parallel", "optimizer.type"),
                           "an optimizer that cannot step FSDP's sharded LoRA (8-bit AdamW, Adafactor)",
                           ("model.parallel = fsdp", "optimizer.type = adamw8bit or adafactor")),
)
"""The rules of this module (``app.preflight.declared_rules`` lists them)."""


def problems(cfg: Any) -> list[Problem]:
    """Every pair of ``cfg`` that a several-GPU layout cannot run (empty: none)."""
    found = []
    if cfg.model.parallel == "fsdp":
        why = FSDP_OPTIMIZERS.get(cfg.optimizer.type)
        if why is not None:
            found.append(FSDP_OPTIMIZER.problem(f"optimizer.type = '{cfg.optimizer.type}' does not run with {FSDP} "
                                                f"({why}); use optimizer.type = 'adamw' or set model.parallel = 'dp'"))
    return found
