"""The plan per GPU of a multi-GPU layout (``wantrain.models.wan22.rank_plan``, docs/distributed.md) against what
FSDP2 really allocates: one process as rank 0 of N on a fake process group shards the real-width T2V-A14B expert
(built on ``meta``, its LoRA added, materialised under fake tensors: no memory is used) and
``FSDPMemTracker`` counts its sharded parameters, gradients and AdamW state after one step; the activations per
GPU against a ``saved_tensors_hooks`` trace of the Ulysses-sharded block on rank 0 of Q (fake process group,
fake tensors, 832x480x81)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from wantrain.core.errors import UserError
from wantrain.core.parallel.sharding import shard_per_block
from wantrain.models.wan22.memory import LORA_BYTES_PER_PARAM
from wantrain.models.wan22.rank_plan import Layout, check_layout, lora_shard_params, rank_estimate, sharded_weight_bytes

LAYERS = 4
"""Blocks of the traced expert: the real width and 4 of its 40 identical blocks (the planner counts per block, so
the blocks add nothing new to check; 40 blocks at N = 8 was traced once, see docs/distributed.md)."""
RANK = 32


def expert_on_meta(layers: int) -> torch.nn.Module:
    """T2V-A14B's real width with ``layers`` blocks on ``meta``: bf16 frozen base, a trainable fp32 rank-32 LoRA."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
    from wantrain.models.wan22.export import LORA_TARGET_REGEX
    from wantrain.models.wan22.variants import VARIANTS

    with torch.device("meta"):
        model = WanTransformer3DModel(**dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=layers))
        cast_keeping_fp32_modules(model, torch.bfloat16)
        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=LORA_TARGET_REGEX), model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return model


def tracked_bytes(shard_degree: int) -> float:
    """Sharded parameters + gradients + optimizer state on rank 0 of ``shard_degree``, by FSDPMemTracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shard_degree)
    try:
        model = expert_on_meta(LAYERS)
        shard_per_block(model, model.blocks)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            lora = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(lora, foreach=False)
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                for p in lora:
                    p.grad = torch.zeros_like(p)
                optimizer.step()
            snapshot = tracker.get_tracker_snapshot("current")
        kinds = ("Sharded Param", "Sharded Grad", "OptState", "Buffer")
        return float(sum(v for per_device in snapshot.values() for k, v in per_device.items()
                         if getattr(k, "value", k) in kinds))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shard_degree", [2, 4, 8])
def test_the_weights_lora_and_optimizer_per_gpu_are_within_5_percent_of_the_fsdp_tracker(shard_degree):
    planned = (sharded_weight_bytes("t2v-a14b", shard_degree, LAYERS)[0]
               + lora_shard_params("t2v-a14b", RANK, shard_degree, LAYERS) * LORA_BYTES_PER_PARAM)
    tracked = tracked_bytes(shard_degree)
    assert abs(planned - tracked) <= 0.05 * tracked, (planned, tracked)
    # and sharding divides: each GPU holds about 1/N of the one-GPU figure
    whole = sharded_weight_bytes("t2v-a14b", 1, LAYERS)[0]
    assert sharded_weight_bytes("t2v-a14b", shard_degree, LAYERS)[0] < 1.1 * whole / shard_degree


def traced_block_bytes(sequence_degree: int) -> float:
    """Bytes autograd saves for the backward in the first block of the real-width T2V-A14B expert (one block, rank-32
    LoRA, bf16 base) on rank 0 of ``sequence_degree`` Ulysses ranks (diffusers' context parallelism on a fake
    process group, everything under fake tensors) at 832x480x81: each saved storage once, parameters not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from wantrain.models.wan22.sequence import enable_ulysses

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sequence_degree)
    try:
        model = expert_on_meta(1)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model.to_empty(device="cpu")
        if sequence_degree > 1:
            enable_ulysses(model, sequence_degree)
        params = {id(p.untyped_storage()) for p in model.parameters()}
        saved: dict[int, Any] = {}  # storage id -> storage (held: an id is never reused while counting)

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if id(storage) not in params:
                saved[id(storage)] = storage
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        block = model.blocks[0]
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
        with fake:  # 21 latent frames of 60 x 104: 32760 tokens after the 2 x 2 patches
            x = torch.randn(1, 16, 21, 60, 104, dtype=torch.bfloat16)
            text = torch.randn(1, 512, 4096, dtype=torch.bfloat16)
            model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)
        return float(sum(s.nbytes() for s in saved.values()))
    finally:
        dist.destroy_process_group()


def test_the_activations_per_gpu_follow_a_trace_of_the_ulysses_sharded_block_within_5_percent():
    """The planner's "one recomputed block" per GPU at sequence degree 1, 2 and 4 against what the Ulysses-sharded
    block really saves on one rank (:func:`traced_block_bytes`): it shrinks as the trace does, within 5 % of the
    trace's ratio to one GPU, and covers what the block saves (the planner's figure is the recompute's backward
    peak, measured on one GPU by bench/trace_memory.py; the saved tensors are part of it)."""
    degrees = (1, 2, 4)
    planned = [rank_estimate("t2v-a14b", Layout(gpus=q, sequence_degree=q), width=832, height=480, frames=81,
                             rank=RANK, layers=LAYERS).parts["one recomputed block"] for q in degrees]
    traced = [traced_block_bytes(q) for q in degrees]
    for q, plan, trace in zip(degrees, planned, traced, strict=True):
        assert abs(plan / planned[0] - trace / traced[0]) <= 0.05 * trace / traced[0], (q, plan, trace)
        assert trace <= plan, (q, plan, trace)
    assert traced[2] < 0.26 * traced[0]  # and the trace does split: a quarter of the tokens, about a quarter


@pytest.mark.parametrize(("variant", "layout", "words"), [
    ("t2v-a14b", Layout(gpus=3, sequence_degree=3), "does not divide the 40 attention heads"),
    ("ti2v-5b", Layout(gpus=16, sequence_degree=16), "valid degrees: 1, 2, 3, 4, 6, 8, 12, 24"),
    ("ti2v-5b", Layout(gpus=2, expert_groups=2), "ti2v-5b has 1 expert(s): expert groups must be 1"),
    ("t2v-a14b", Layout(gpus=6, expert_groups=2, shard_degree=2), "does not divide the 3 GPU(s) of each expert"),
    ("t2v-a14b", Layout(gpus=3, expert_groups=2), "3 GPUs cannot be split into 2 expert groups"),
])
def test_a_layout_the_model_cannot_run_is_refused_in_one_line(variant, layout, words):
    with pytest.raises(UserError) as refused:
        check_layout(variant, layout)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("settings", "lora", "attention"), [
    (("bf16",), "lora", "sdpa"),
    (("bf16", 0, False, "lean"), "dora", "sdpa"),
    (("fp8_scaled", 10, True, "block"), "lokr", "flash"),
])
def test_the_plan_per_gpu_at_one_gpu_is_the_one_gpu_plan(settings, lora, attention):
    """``check --gpus N`` plans like the one-GPU planner: the same settings, adapter type, kernel and recompute; at
    one GPU its parts add up to the one-GPU estimate's (and the adapter type changes the plan per GPU alike)."""
    from wantrain.models.wan22.memory import AdapterSpec, MemorySettings, estimate

    plan = dict(width=832, height=480, frames=81, rank=32, layers=4, settings=MemorySettings(*settings),
                adapter=AdapterSpec(type=lora), attention=attention)
    one = estimate("t2v-a14b", plan.pop("settings"), **plan)
    per_gpu = rank_estimate("t2v-a14b", Layout(gpus=1), settings=MemorySettings(*settings), **plan)
    assert per_gpu.total == pytest.approx(one.allocated, rel=1e-12)
    assert per_gpu.attention_backward == one.attention_backward
    sharded = rank_estimate("t2v-a14b", Layout(gpus=4, shard_degree=4), **plan)
    plain = rank_estimate("t2v-a14b", Layout(gpus=4, shard_degree=4), **{**plan, "adapter": AdapterSpec()})
    assert (sharded.parts["LoRA + optimizer"] == plain.parts["LoRA + optimizer"]) == (lora == "lora")
