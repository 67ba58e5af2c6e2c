"""Epochs as optimizer steps: what ``train.max_epochs`` and the ``*_every_epochs`` keys mean for a data plan.

One optimizer step takes ``grad_accum`` micro-batches (plan entries). ``max_epochs = E`` is the number of optimizer
steps that covers the micro-batches of the first E epochs of the plan, rounded up (the last step may reach into the
next epoch when an epoch is not a multiple of ``grad_accum``). "Every N epochs" is the optimizer steps that cover the
first N epochs, then the same interval again (the loop's ``save_every`` is a fixed interval): the first such save
lands exactly at the end of epoch N; with ``remainder = "carry"`` epochs may differ by up to one batch per bucket, so
a later one may land a few steps off an epoch's end.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class EpochSteps:
    """The micro-batches of each epoch of a plan (``TrainingData.micro_batches_per_epoch``) and ``grad_accum``."""

    micro_batches: tuple[int, ...]
    grad_accum: int = 1

    @classmethod
    def of(cls, data, epochs: int, grad_accum: int) -> EpochSteps:
        return cls(tuple(data.micro_batches_per_epoch(max(1, epochs))), grad_accum)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the first epoch (rounded up)."""
        return math.ceil(self.micro_batches[0] / self.grad_accum)

    def steps_for(self, epochs: int) -> int:
        """Optimizer steps that cover the first ``epochs`` epochs."""
        if epochs > len(self.micro_batches):
            raise ValueError(f"planned {len(self.micro_batches)} epochs, asked for {epochs}")  # a bug
        return math.ceil(sum(self.micro_batches[:epochs]) / self.grad_accum)

    def every(self, epochs: int) -> int:
        """Optimizer steps of "every ``epochs`` epochs": those of the first ``epochs`` epochs."""
        return self.steps_for(epochs)
