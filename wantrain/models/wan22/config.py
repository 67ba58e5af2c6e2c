"""Config sections of the Wan 2.2 model family: ``[model]`` and ``[lora]``. (Stub: the models helper owns it.)"""

from __future__ import annotations

from pathlib import Path

from wantrain.core.config import at_least, above, section, setting


@section
class ModelConfig:
    """The Wan 2.2 model to train."""

    variant: str = setting(
        "tiny-t2v",
        doc="Model variant.",
        choices=("t2v-a14b", "i2v-a14b", "ti2v-5b", "tiny-t2v", "tiny-i2v", "tiny-ti2v"),
    )
    path: Path | None = setting(None, doc="Local diffusers-format model directory (required for real variants).")
    shift: float = setting(1.0, doc="Timestep shift s: t' = s*t / (1 + (s-1)*t).", range=above(0.0))


@section
class LoraConfig:
    """The LoRA adapters."""

    rank: int = setting(16, doc="LoRA rank.", range=at_least(1))
    alpha: float = setting(16.0, doc="LoRA alpha; the LoRA output is scaled by alpha/rank.", range=above(0.0))
