"""Shared test helpers for the scheduler tests (no fixtures with side effects)."""

from __future__ import annotations

import torch

from wantrain.app.config import RunConfig
from wantrain.core.config import structure


def sched_cfg(**table):
    """A SchedulerConfig built exactly as the config loader builds `[lr_scheduler]`."""
    return structure(RunConfig, {"lr_scheduler": table}).lr_scheduler


def two_expert_optimizer(high: float = 1e-4, low: float = 5e-5) -> torch.optim.Optimizer:
    """AdamW over two named groups with their own base LR, as the trainer builds for two-expert variants."""
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": high, "name": "high_noise"},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": low, "name": "low_noise"},
    ]
    return torch.optim.AdamW(groups, lr=high)


def run_steps(optimizer, scheduler, n: int) -> list[list[float]]:
    """LRs before each of ``n`` optimizer steps (the LR that step uses), stepping the scheduler after each."""
    seen = []
    for _ in range(n):
        seen.append(scheduler.get_last_lr())
        optimizer.step()
        scheduler.step()
    return seen
