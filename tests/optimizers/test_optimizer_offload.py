"""The expert offload moves every optimizer type's state with the inactive expert: Adam moments, 8-bit quantized
moments with their block maxima and maps, Prodigy's s and p0, Adafactor's factored row/column statistics,
schedule-free's z. On the CPU the only other device is ``meta`` (see tests/models/test_wan22_experts.py)."""

from __future__ import annotations

import pytest
import torch

from tests.models.wan22_helpers import make_adapter, raw_batch
from wantrain.optimizers import OptimizerConfig, build_optimizer

ARGUMENTS = {"adamw8bit": {"min_8bit_size": 16}}  # the tiny model's LoRA tensors would otherwise keep 32-bit state


def _train_both_experts(adapter, optimizer, batch) -> None:
    """One step of each expert, so that both have optimizer state."""
    generator = torch.Generator().manual_seed(1)
    for step in (1, 2):
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        adapter.loss(batch, expert, generator).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"])
def test_the_inactive_experts_optimizer_state_moves_with_it(kind):
    adapter = make_adapter("tiny-t2v", switch_every=1)
    batch = adapter.encode_batch(raw_batch())
    optimizer = build_optimizer(OptimizerConfig(type=kind, arguments=ARGUMENTS.get(kind, {})),
                                adapter.param_groups(), torch.device("cpu"))
    if kind == "adamw_schedulefree":
        optimizer.train()
    _train_both_experts(adapter, optimizer, batch)

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


def test_every_tensor_state_of_a_fused_group_follows_its_parameter():
    """Fused (and capturable) AdamW keeps its 0-dim ``step`` on the parameter's device, and the fused kernel reads it
    there; after a resume ``load_state_dict`` puts the offloaded expert's steps on the host. An expert move must take
    them along, like every other tensor of its state."""
    adapter = make_adapter("tiny-t2v", switch_every=1)
    batch = adapter.encode_batch(raw_batch())
    optimizer = build_optimizer(OptimizerConfig(type="adamw"), adapter.param_groups(), torch.device("cpu"))
    assert all(group["fused"] for group in optimizer.param_groups)  # the default on CPU and CUDA
    _train_both_experts(adapter, optimizer, batch)
    optimizer.load_state_dict(optimizer.state_dict())  # what a resume does

    adapter.offload_device = torch.device("meta")
    adapter.activate("high_noise", optimizer)
    elsewhere = [(key, value.device) for p in adapter.trainable_parameters()
                 for key, value in optimizer.state[p].items()
                 if isinstance(value, torch.Tensor) and value.device != p.device]
    assert elsewhere == []
    steps = [optimizer.state[p]["step"] for p in adapter.trainable_parameters("low_noise")]
    assert len(steps) == 40 and {s.device.type for s in steps} == {"meta"}


def test_a_plain_adamw_step_count_stays_on_the_host_and_paged_state_stays_in_place():
    """Non-fused, non-capturable AdamW keeps ``step`` on the host (reading it costs no sync there), and
    bitsandbytes' paged state (``is_paged``: unified memory the driver pages) must not be copied into plain
    device memory by an expert move."""
    adapter = make_adapter("tiny-t2v", switch_every=1)
    optimizer = torch.optim.AdamW(adapter.param_groups(), foreach=True)
    low = adapter.trainable_parameters("low_noise")
    paged = torch.zeros(4)
    paged.is_paged = True
    for p in low:
        optimizer.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros_like(p), "state1": paged}
    adapter.offload_device = torch.device("meta")
    adapter.activate("high_noise", optimizer)
    low = adapter.trainable_parameters("low_noise")
    assert {optimizer.state[p]["exp_avg"].device.type for p in low} == {"meta"}
    assert {optimizer.state[p]["step"].device.type for p in low} == {"cpu"}
    assert all(optimizer.state[p]["state1"] is paged for p in low)
