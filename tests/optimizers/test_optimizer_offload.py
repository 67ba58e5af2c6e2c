"""The expert offload moves every optimizer type's state with the inactive expert: Adam moments, 8-bit quantized
moments with their block maxima and maps, Prodigy's s and p0, Adafactor's factored row/column statistics,
schedule-free's z. On the CPU the only other device is ``meta`` (see tests/models/test_wan22_experts.py)."""

from __future__ import annotations

import pytest
import torch

from tests.models.wan22_helpers import make_adapter, raw_batch
from wantrain.optimizers import OptimizerConfig, build_optimizer

ARGUMENTS = {"adamw8bit": {"min_8bit_size": 16}}  # the tiny model's LoRA tensors would otherwise keep 32-bit state


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"])
def test_the_inactive_experts_optimizer_state_moves_with_it(kind):
    adapter = make_adapter("tiny-t2v", switch_every=1)
    batch = adapter.encode_batch(raw_batch())
    optimizer = build_optimizer(OptimizerConfig(type=kind, arguments=ARGUMENTS.get(kind, {})),
                                adapter.param_groups(), torch.device("cpu"))
    if kind == "adamw_schedulefree":
        optimizer.train()
    generator = torch.Generator().manual_seed(1)
    for step in (1, 2):
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        adapter.loss(batch, expert, generator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    adapter.offload_device = torch.device("meta")
    adapter.activate("high_noise", optimizer)
    low = adapter.trainable_parameters("low_noise")
    assert {p.device.type for p in low} == {"meta"}
    moved = [v for p in low for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert len(moved) >= 2 * len(low) and {v.device.type for v in moved} == {"meta"}
    high = adapter.trainable_parameters("high_noise")
    kept = [v for p in high for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert kept and {v.device.type for v in kept} == {"cpu"}
    if kind == "adamw8bit":
        assert any(v.dtype == torch.uint8 for v in moved)  # the quantized moments went along
    if kind == "adafactor":
        assert any(v.dim() == 1 and v.numel() < p.numel() for p in low for v in optimizer.state[p].values()
                   if isinstance(v, torch.Tensor))  # factored statistics
