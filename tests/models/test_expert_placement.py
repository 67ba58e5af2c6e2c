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


def _frozen_bytes(module, where=None) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
               if not t.requires_grad and (where is None or t.device == where))


def test_a_sampling_only_expert_keeps_one_host_copy_and_never_shares_the_device_with_the_trained_one():
    """One trained expert plus the other one for sampling (``add_sampling_expert``): it waits on the host, comes in
    and goes out like a trained expert, its device copy is dropped when it leaves (nothing copied back) and its
    host copy is the one it was loaded into, every time."""
    seen: list[list] = []
    adapter = None

    def resident() -> list:
        return [e for e in adapter.placement.where
                if any(t.device == DEVICE for t in [*adapter.transformer_for(e).parameters(),
                                                     *adapter.transformer_for(e).buffers()] if not t.requires_grad)]

    with MetaAsDevice(on_device_tensor=lambda: adapter is not None and seen.append(resident())) as device:
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", experts="low_noise")
        optimizer = _with_state(adapter)
        assert adapter.add_sampling_expert() == "high_noise"
        seen.clear()
        high, low = adapter.transformer_for("high_noise"), adapter.transformer_for("low_noise")
        host = [t.data_ptr() for t in [*high.parameters(), *high.buffers()]]
        frozen, low_base = _frozen_bytes(high, HOST), _frozen_bytes(low)
        lora = sum(p.numel() * p.element_size() for p in adapter.trainable_parameters("low_noise"))
        assert adapter.placement.where == {"low_noise": DEVICE, "high_noise": HOST}
        assert frozen == _frozen_bytes(high) and not any(p.requires_grad for p in high.parameters())
        device.copies.clear()
        for expert in ("high_noise", "low_noise", "high_noise", "low_noise"):  # two sampling rounds
            adapter.activate(expert, optimizer)
            assert resident() == [expert]
        assert [t.data_ptr() for t in [*high.parameters(), *high.buffers()]] == host  # the same host copy
    assert len(seen) > 50 and max(len(r) for r in seen) == 1, "two experts were on the device at once"
    assert device.bytes("to_host") == 2 * 3 * lora  # the trained expert's LoRA and moments; no base weight
    assert device.bytes("to_device") == 2 * frozen + 2 * (low_base + 3 * lora)
    assert adapter.trainable_parameters() == adapter.trainable_parameters("low_noise")


def test_a_sampling_only_expert_gets_its_own_block_swap_and_keeps_no_block_on_the_device_when_it_leaves():
    with MetaAsDevice() as device:
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", experts="low_noise",
                               gradient_checkpointing=True, blocks_to_swap=1)
        optimizer = _with_state(adapter)
        adapter.add_sampling_expert()
        swap = adapter.swap_for("high_noise")
        high = adapter.transformer_for("high_noise")
        waiting = _frozen_bytes(high, HOST)  # what the placement keeps for it: the swapped block left out
        device.copies.clear()
        adapter.activate("high_noise", optimizer)
        assert device.bytes("to_device") == waiting  # its base without the swapped block
        swap.load(1)  # as during its forward pass: the swapped block in its ring
        device.copies.clear()
        adapter.activate("low_noise", optimizer)
    assert swap.host_bytes() > 0 and swap.loaded == () and swap.live_blocks() == []
    assert device.bytes("to_host") == 0  # nothing of it is copied back
    assert adapter.placement.where == {"low_noise": DEVICE, "high_noise": HOST}
