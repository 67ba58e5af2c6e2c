"""The training device never holds two experts, and switching an expert out copies none of its frozen base weights
back (models/wan22/placement.py). On a CPU-only machine ``meta`` plays the GPU (tests/simulated_device.py), so what
is on the device and what travels is observed op by op."""

from __future__ import annotations

import torch
from wan22_helpers import make_adapter

from tests.simulated_device import DEVICE, HOST, MetaAsDevice


def _resident(adapter) -> list:
    """Experts with any frozen base tensor on the simulated device."""
    return [e for e in adapter.experts
            if any(t.device == DEVICE for t in [*adapter.transformer_for(e).parameters(),
                                                 *adapter.transformer_for(e).buffers()] if not t.requires_grad)]


def _with_state(adapter) -> torch.optim.Optimizer:
    """An AdamW whose every LoRA parameter has state (moments and a step), as after training both experts."""
    optimizer = torch.optim.AdamW(adapter.param_groups(), foreach=False)
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


def test_the_training_device_never_holds_two_experts():
    seen: list[list] = []
    adapter = None
    with MetaAsDevice(on_device_tensor=lambda: adapter is not None and seen.append(_resident(adapter))):
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1)
        optimizer = _with_state(adapter)
        # a switch each way, a validation round that visits both experts and returns, a sampling round
        for expert in ("low_noise", "high_noise", "low_noise", "high_noise", "low_noise", "low_noise"):
            adapter.activate(expert, optimizer)
            assert _resident(adapter) == [expert]
    assert len(seen) > 100  # every device tensor the switches created was checked
    assert max(len(r) for r in seen) == 1, "two experts were on the device at once"


def test_switching_an_expert_out_copies_only_its_lora_and_optimizer_state_to_the_host():
    with MetaAsDevice() as device:
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1)
        optimizer = _with_state(adapter)
        high = adapter.transformer_for("high_noise")
        lora = sum(p.numel() * p.element_size() for p in adapter.trainable_parameters("high_noise"))
        base = sum(t.numel() * t.element_size() for t in [*high.parameters(), *high.buffers()] if not t.requires_grad)
        device.copies.clear()
        adapter.activate("low_noise", optimizer)  # high_noise leaves the device
    assert base > 5 * lora
    assert device.bytes("to_host") == 3 * lora  # the LoRA weights and the two AdamW moments; no base weight
    assert {t.device for t in high.parameters() if not t.requires_grad} == {HOST}


def test_a_switch_with_block_swap_moves_no_swapped_block_and_the_leaving_expert_keeps_none_on_the_device():
    with MetaAsDevice() as device:
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1,
                               gradient_checkpointing=True, blocks_to_swap=1)
        optimizer = _with_state(adapter)
        low = adapter.transformer_for("low_noise")
        waiting = sum(t.numel() * t.element_size() for t in [*low.parameters(), *low.buffers()]
                      if not t.requires_grad and t.device == HOST)  # what the placement keeps for low_noise
        lora = sum(p.numel() * p.element_size() for p in adapter.trainable_parameters("low_noise"))
        adapter.swap_for("high_noise").load(1)  # as after a training step: block 1 of high_noise in its ring
        device.copies.clear()
        adapter.activate("low_noise", optimizer)
    swapped = adapter.swap_for("low_noise").host_bytes()
    assert swapped > lora  # the swapped block is big enough to show in the byte counts
    assert device.bytes("to_device") == waiting + 3 * lora  # its base (swapped block left out), LoRA, moments
    assert adapter.swap_for("high_noise").loaded == () and adapter.swap_for("high_noise").live_blocks() == []
