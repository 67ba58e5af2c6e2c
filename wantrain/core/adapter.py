"""The contract between the core and a model family (``wantrain.models.wan22`` implements it).

The core knows nothing about Wan: it asks the adapter which expert a step trains, for the loss of a batch, and
for the parameter groups the optimizer sees. Observers that must act on the model (the future alpha controller)
reach the adapter through ``ctx.adapter``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelAdapter(Protocol):
    """What the training loop needs from a model.

    ``experts`` lists the experts trained in this run in a fixed order (``("high_noise", "low_noise")``, one of
    them, or ``(None,)`` for a single-transformer model).
    """

    experts: tuple[str | None, ...]
    device: torch.device

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups: dicts with ``params``, ``lr`` and a unique ``name`` (``high_noise``, ...)."""
        ...

    def expert_for_step(self, step: int) -> str | None:
        """The expert trained at optimizer step ``step`` (1-based). Pure function of ``step``: resume-safe."""
        ...

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Make ``expert`` the trained one: move it (and its optimizer state) to the training device and move the
        other expert off it. Called by the core before the first step and at every switch."""
        ...

    def loss(self, batch: Mapping[str, Any], expert: str | None, generator: torch.Generator) -> torch.Tensor:
        """The scalar training loss of ``batch`` for ``expert`` (forward pass; no backward, no sync)."""
        ...

    def trainable_parameters(self, expert: str | None = None) -> Sequence[torch.nn.Parameter]:
        """LoRA parameters of ``expert`` (all trained experts when ``None``), in a stable order."""
        ...


class Saver(Protocol):
    """Writes the trained LoRA (the format is the model family's business, not the loop's)."""

    def save(self, step: int, final: bool) -> Sequence[str]:
        """Write the LoRA file(s) for ``step``; return the paths written."""
        ...


class NullSaver:
    """A saver that writes nothing (tests, LR-finder style runs)."""

    def save(self, step: int, final: bool) -> Sequence[str]:
        return ()


Batches = Iterable[Mapping[str, Any]]
