"""A tiny stand-in model adapter for core tests: a linear regression with an optional expert pair.

It satisfies ``wantrain.core.adapter.ModelAdapter`` and learns, so loop tests can assert outcomes without
building a Wan model. End-to-end tests use the real tiny Wan model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch


class LinearAdapter:
    def __init__(self, experts: tuple[str | None, ...] = (None,), switch_every: int = 1, seed: int = 0,
                 oom_at_micro_steps: tuple[int, ...] = ()) -> None:
        torch.manual_seed(seed)
        self.experts = experts
        self.device = torch.device("cpu")
        self.switch_every = switch_every
        self.models = {e: torch.nn.Linear(4, 1) for e in experts}
        self.oom_at = set(oom_at_micro_steps)
        self.calls = 0
        self.activated: list[str | None] = []

    def param_groups(self) -> list[dict]:
        return [{"params": list(m.parameters()), "lr": 0.05, "name": e or "lora"} for e, m in self.models.items()]

    def expert_for_step(self, step: int) -> str | None:
        return self.experts[((step - 1) // self.switch_every) % len(self.experts)]

    def activate(self, expert, optimizer) -> None:
        self.activated.append(expert)

    def loss(self, batch, expert, generator) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        pred = self.models[expert](batch["x"])
        return torch.nn.functional.mse_loss(pred, batch["y"])

    def trainable_parameters(self, expert=None):
        if expert is None:
            return [p for m in self.models.values() for p in m.parameters()]
        return list(self.models[expert].parameters())


def linear_batches(seed: int = 0) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for _ in itertools.count():
        x = torch.randn(8, 4, generator=g)
        yield {"x": x, "y": x @ w + 0.1}


class LinearBatches:
    """``linear_batches`` with a resumable position (``state_dict``/``load_state_dict``), like the data stream."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[dict]:
        source = linear_batches(self.seed)
        for _ in range(self.position):
            next(source)
        for batch in source:
            self.position += 1
            yield batch
