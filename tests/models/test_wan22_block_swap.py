"""Block swap (``model.blocks_to_swap``) and activation offload (``model.offload_activations``) on a CPU.

On a CPU "device" and "host" are the same kind of memory, so the swap is checked by what it does, not by where
bytes live: every host->device block copy is recorded (``on_copy``), an unloaded swapped block holds ``meta``
placeholders (running it would fail), and the swapped blocks whose device copies are still alive are counted with
storage weak references at every aten op of a forward and backward pass (a dispatch mode), so a copy kept alive by
autograd after its eviction counts too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusers import WanTransformer3DModel
from peft import LoraConfig as PeftLoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

from wantrain.models.wan22.export import ADAPTER_NAME, LORA_TARGET_REGEX
from wantrain.models.wan22.offload import ActivationOffload
from wantrain.models.wan22.swap import BlockSwap

SIX_BLOCKS = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=256,
                  ffn_dim=32, num_layers=6, eps=1e-6, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=32, pos_embed_seq_len=None,
                  in_channels=16, out_channels=16)
CPU = torch.device("cpu")


def six_block_model() -> WanTransformer3DModel:
    """A tiny Wan transformer with six blocks, a LoRA with random B (so every LoRA gets a gradient), checkpointed."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(**SIX_BLOCKS)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(PeftLoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGET_REGEX), adapter_name=ADAPTER_NAME)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f".{ADAPTER_NAME}." in name:
                param.requires_grad_(True)
                if "lora_B" in name:
                    param.normal_()
    return model.train()


class CountLiveBlocks(TorchDispatchMode):
    """The most swapped blocks with a live device copy seen after any aten op."""

    def __init__(self, swap: BlockSwap) -> None:
        super().__init__()
        self.swap = swap
        self.most = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.most = max(self.most, len(self.swap.live_blocks()))
        self.ops += 1
        return out


def step(model, mode=None) -> dict[str, torch.Tensor]:
    """One forward and backward on fixed inputs; the LoRA gradients by name."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 8, 8, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    with mode if mode is not None else contextlib.nullcontext():
        out = model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]
        (out**2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_swapped_blocks_give_the_same_gradients_with_at_most_the_ring_alive_at_any_op():
    reference = step(six_block_model())
    model = six_block_model()
    copies: list[int] = []
    swap = BlockSwap(model, model.blocks, [2, 3, 4, 5], CPU, ring=2, on_copy=copies.append)
    watch = CountLiveBlocks(swap)
    grads = step(model, watch)
    assert grads.keys() == reference.keys() and len(grads) == 6 * 20
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert watch.ops > 1000 and watch.most == 2  # two slots in use, never three
    # Forward: each block copied ahead in order; recompute runs backwards and finds 4 and 5 still resident.
    assert copies == [2, 3, 4, 5, 3, 2]
    assert swap.loaded == (3, 2)
    # The next step finds 2 and 3 resident; nothing is ever copied back (BlockSwap has no device->host path).
    copies.clear()
    assert all(torch.equal(v, reference[k]) for k, v in step(model, watch).items())
    assert copies == [4, 5, 3, 2] and watch.most == 2


def test_an_unloaded_swapped_block_holds_placeholders_and_cannot_run_by_mistake():
    model = six_block_model()
    swap = BlockSwap(model, model.blocks, [4, 5], CPU)
    assert {p.device.type for p in model.blocks[5].parameters() if not p.requires_grad} == {"meta"}
    assert {p.device.type for p in model.blocks[5].parameters() if p.requires_grad} == {"cpu"}  # LoRA stays
    swap.remove()  # hooks gone: block 5 is still on placeholders only if remove() forgot to restore it
    assert {p.device.type for p in model.blocks[5].parameters()} == {"cpu"}
    swap = BlockSwap(model, model.blocks, [4, 5], CPU)
    for handle in swap._handles:  # without the hooks nothing loads block 4: running it must fail, not compute
        handle.remove()
    with pytest.raises((RuntimeError, NotImplementedError)):
        step(model)


def test_release_drops_every_device_copy():
    model = six_block_model()
    swap = BlockSwap(model, model.blocks, [3, 4, 5], CPU, ring=2)
    step(model)
    assert swap.loaded
    swap.release()
    assert swap.loaded == () and swap.live_blocks() == []


def test_a_ring_of_one_slot_loads_each_block_when_it_runs():
    reference = step(six_block_model())
    model = six_block_model()
    copies: list[int] = []
    swap = BlockSwap(model, model.blocks, [3, 4, 5], CPU, ring=1, on_copy=copies.append)
    watch = CountLiveBlocks(swap)
    assert all(torch.equal(v, reference[k]) for k, v in step(model, watch).items())
    assert copies == [3, 4, 5, 4, 3] and watch.most == 1


def test_offloaded_activations_give_the_same_gradients_and_copy_the_block_inputs_once_each():
    reference = step(six_block_model())
    model = six_block_model()
    packed: list[int] = []
    offload = ActivationOffload(CPU, "cpu", min_bytes=512, on_pack=packed.append)
    with offload.active():
        grads = step(model)
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    hidden, text, modulation = 3 * 4 * 4 * 24 * 4, 8 * 24 * 4, 6 * 24 * 4  # tokens x width x fp32, ...
    assert packed.count(hidden) == 7  # the six blocks' inputs and the output norm's
    assert packed.count(text) == 1 and packed.count(modulation) == 1  # given to every block, copied once


def offload_timeline(prefetch: bool):
    """One step of the six-block model with activation offload: the gradients, which block each offloaded tensor
    was saved for (its place in the save order -> block), and the backward pass's timeline: ("copy", place) for
    every host->device copy, ("run", k) when block k's recompute starts."""
    model = six_block_model()
    events: list[tuple[str, int]] = []
    offload = ActivationOffload(CPU, "cpu", min_bytes=512, prefetch=prefetch,
                                on_copy_back=lambda place, nbytes: events.append(("copy", place)))
    saved_before: dict[int, int] = {}  # block -> places saved before its forward starts (its inputs: the last ones)

    def before(k):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:
                events.append(("run", k))
            elif k not in saved_before:
                saved_before[k] = offload.packed
        return hook

    for k, block in enumerate(model.blocks):
        block.register_forward_pre_hook(before(k))
    with offload.active():
        grads = step(model)
    owner = {}
    for k in range(6):
        for place in range(saved_before[k - 1] if k else 0, saved_before[k]):
            owner[place] = k
    return grads, owner, events


def test_offloaded_block_inputs_come_back_while_the_next_block_recomputes_and_the_gradients_stay_equal():
    reference = step(six_block_model())
    grads, owner, events = offload_timeline(prefetch=True)
    assert grads.keys() == reference.keys() and all(torch.equal(grads[k], reference[k]) for k in reference)
    copies = [place for kind, place in events if kind == "copy"]
    assert sorted(copies) == sorted(set(copies)) and set(owner) <= set(copies)  # each copied back once
    runs = [events.index(("run", k)) for k in range(6)]
    assert runs == sorted(runs, reverse=True)  # the recompute goes from the last block to the first
    for k in range(1, 6):  # block k-1's inputs are all on their way before block k's recompute starts
        inputs = [events.index(("copy", place)) for place, block in owner.items() if block == k - 1]
        assert inputs and max(inputs) < runs[k], (k, events)
    # without the prefetch each block's inputs come back only when its own recompute needs them
    _, owner, events = offload_timeline(prefetch=False)
    k = 3
    late = [events.index(("copy", place)) for place, block in owner.items() if block == k - 1]
    assert min(late) > events.index(("run", k))


def adapter_run(**model):
    """Six steps of tiny-t2v through two expert switches; the adapter and both LoRAs in Wan naming."""
    from wan22_helpers import make_adapter, raw_batch, train_steps

    from wantrain.models.wan22.export import wan_state_dict

    torch.manual_seed(0)  # peft draws lora_A from the global generator (the runner seeds it the same way)
    adapter = make_adapter(gradient_checkpointing=True, switch_every=2, **model)
    train_steps(adapter, adapter.encode_batch(raw_batch()), 6)
    return adapter, {e: wan_state_dict(adapter.transformer_for(e), torch.float32) for e in adapter.experts}


@pytest.mark.parametrize("model", [{"blocks_to_swap": 1}, {"blocks_to_swap": 2, "offload_activations": True}],
                         ids=["swap 1", "swap 2 + offload"])
def test_the_adapter_with_swap_trains_the_same_loras_and_the_inactive_expert_keeps_no_block(model):
    _, reference = adapter_run()
    adapter, loras = adapter_run(**model)
    assert all(torch.equal(loras[e][k], reference[e][k]) for e in reference for k in reference[e])
    assert adapter.active == "high_noise"
    assert adapter.swap_for("high_noise").loaded  # the training expert keeps its ring between steps
    inactive = adapter.swap_for("low_noise")
    assert inactive.loaded == () and inactive.live_blocks() == []
