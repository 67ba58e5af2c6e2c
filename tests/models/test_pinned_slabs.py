"""Pinned host memory carved from slabs (``models/wan22/pinned.py``) and its users: block swap, the expert placement's
waiting copies and activation offload. Pinned memory cannot be made in a CPU build of torch, so the pin function
(``pinned.allocate_pinned``) is replaced by a recorder handing out ordinary host memory, and ``pinned.pinnable`` says
yes for the CPU "device"; what is checked is the layout, what the owners allocate, and that the values survive."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.models.test_wan22_block_swap import CPU, six_block_model, step
from wantrain.models.wan22 import pinned
from wantrain.models.wan22.memory import GIB, MemorySettings, host_estimate, host_tensor_bytes, offload_host_tensors
from wantrain.models.wan22.offload import ActivationOffload
from wantrain.models.wan22.swap import BlockSwap


class Recorder:
    """Stands in for ``pinned.allocate_pinned``: the sizes asked for, slabs filled with 0xAB (reading a place never
    written shows), or ``RuntimeError`` as a driver refusing page-locked memory does."""

    def __init__(self, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.slabs: list[torch.Tensor] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory\n(more lines)")
        self.sizes.append(nbytes)
        slab = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
        self.slabs.append(slab)
        return slab


@pytest.fixture
def pins(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(pinned, "allocate_pinned", recorder)
    monkeypatch.setattr(pinned, "pinnable", lambda device: True)
    return recorder


def _storage_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, end byte) of ``t`` within its storage."""
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()


def test_carved_views_are_aligned_non_overlapping_and_of_the_right_shapes_and_dtypes(pins):
    specs = [((3, 70), torch.bfloat16), ((5,), torch.float32), ((), torch.float32), ((2, 3, 4), torch.float8_e4m3fn),
             ((0, 4), torch.float32), ((1000,), torch.bool), ((7, 7), torch.int64), ((3000, 100), torch.uint8)]
    slabs = pinned.PinnedSlabs("test")
    views = dict(slabs.views(specs))
    assert sorted(views) == list(range(len(specs)))
    assert views[4] is None  # a size of 0 takes no place
    carved = {i: v for i, v in views.items() if v is not None}
    for i, view in carved.items():
        assert tuple(view.shape) == specs[i][0] and view.dtype == specs[i][1] and view.is_contiguous()
        assert _storage_span(view)[1] % pinned.ALIGN == 0
    spans = sorted(_storage_span(v) for v in carved.values())
    for (ptr_a, _, end_a), (ptr_b, start_b, _) in zip(spans, spans[1:], strict=False):
        assert ptr_a != ptr_b or end_a <= start_b  # no two views share a byte
    slab_of = {s.untyped_storage().data_ptr(): s.numel() for s in pins.slabs}
    assert all(end <= slab_of[ptr] for ptr, _, end in spans)  # inside their slab
    assert pins.sizes == slabs.slabs == list(pinned.slab_layout(
        tuple(pinned._nbytes(s, d) for s, d in specs)).slabs)
    assert all(n & (n - 1) == 0 for n in pins.sizes)  # powers of two: torch's pinned allocator adds nothing
    for i, view in carved.items():  # each holds its own values
        view.reshape(-1).view(torch.uint8).fill_(i)
    assert all(bool((v.reshape(-1).view(torch.uint8) == i).all()) for i, v in carved.items())


def test_the_layout_depends_only_on_the_sizes_and_a_slab_holds_a_tensor_larger_than_the_cap():
    sizes = (5000, 300, 70_000, 300, 1, 2**20 + 1)
    layout = pinned.slab_layout(sizes, 2**16)
    assert layout.slabs == pinned.slab_layout(tuple(reversed(sizes)), 2**16).slabs
    assert max(layout.slabs) == 2**21  # the 1 MiB + 1 tensor gets a slab of its own, over the 64 KiB cap
    assert sum(layout.slabs) < sum(pinned.pow2_ceil(s) for s in sizes)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_the_a14b_plans_pinned_slabs_take_within_a_few_percent_of_their_tensors(dtype):
    """The 24 GB plan's host tensors: its 33 swapped blocks and the waiting copies of the rest, per expert, and the
    offload buffers at 832x480x81 and 1280x720x81. Pinned tensor by tensor they took 1.53x (the slabs: <= 1.03x)."""
    rest, blocks = host_tensor_bytes("t2v-a14b", dtype)
    swapped = [s for block in blocks[7:] for s in block]
    placed = [*rest, *(s for block in blocks[:7] for s in block)]
    for sizes in (swapped, placed):
        assert sum(pinned.pow2_ceil(s) for s in sizes) > 1.5 * sum(sizes)  # what tensor-by-tensor pinning took
        assert pinned.slab_bytes(sizes) <= 1.03 * sum(sizes)
        assert max(pinned.slab_layout(tuple(sizes)).slabs) <= pinned.WEIGHT_SLAB_MAX
        # large slabs (1 GiB but for a few smaller ones at the end), not one allocation per tensor (27 a block)
        assert len(pinned.slab_layout(tuple(sizes)).slabs) <= sum(sizes) // pinned.WEIGHT_SLAB_MAX + 8
    for width, height in ((832, 480), (1280, 720)):
        buffers = offload_host_tensors("t2v-a14b", width=width, height=height, frames=81)
        assert pinned.slab_bytes(buffers, pinned.OFFLOAD_SLAB_MAX) <= 1.07 * sum(buffers)


def test_the_host_estimate_counts_the_slabs_the_run_pins_for_the_64_gb_plan():
    """fp8, 33 blocks swapped, offload: the estimate's slab lines are what the slabs take beyond the tensors, and
    near zero (the old per-tensor rounding: 14 GiB on the copies, 8 GiB on the offload buffers)."""
    size = dict(rank=32, width=832, height=480, frames=81)
    est = host_estimate("t2v-a14b", MemorySettings("fp8", 33, True), experts=("high_noise", "low_noise"), cuda=True,
                        pin_budget=32 * GIB, **size)
    copies = sum(v for k, v in est.parts.items() if "host copy" in k)
    assert 0 < est.parts["pinned slabs' unused ends"] <= 0.03 * copies
    buffers = offload_host_tensors("t2v-a14b", width=832, height=480, frames=81)
    offload_waste = est.phases["while training"]["offload slabs' unused ends"]
    assert offload_waste == pinned.slab_bytes(buffers, pinned.OFFLOAD_SLAB_MAX) - sum(buffers)
    assert 0 < offload_waste <= 0.07 * sum(buffers)
    assert est.pinned == "swap and waiting copies pinned" and est.peak <= 60 * GIB


def test_the_offload_pool_plans_the_slabs_the_host_estimate_counts(pins):
    """The offload's slabs for A14B's 42 buffers a step (fake tensors: nothing is allocated): the first forward gets
    pageable buffers, the second plans the slabs, and they are the estimate's bytes exactly."""
    sizes = offload_host_tensors("t2v-a14b", width=832, height=480, frames=81)
    pool = pinned.SlabPool("test")
    with FakeTensorMode():
        for forward in range(3):
            pool.start()
            buffers = [pool.take((n // 2,), torch.bfloat16) for n in sizes]
            assert all(b.nbytes == n for b, n in zip(buffers, sizes, strict=True))
            del buffers
            if forward == 0:
                assert pins.sizes == []  # nothing planned yet: pageable
    est = host_estimate("t2v-a14b", MemorySettings("fp8", 33, True), experts=("high_noise", "low_noise"), cuda=True,
                        rank=32, width=832, height=480, frames=81, pin_budget=32 * GIB)
    assert sum(pins.sizes) == sum(pool.slabs) == sum(sizes) + est.phases["while training"]["offload slabs' unused ends"]


def test_block_swap_through_slab_views_gives_the_same_gradients_and_frees_nothing_it_still_needs(pins):
    reference = step(six_block_model())
    model = six_block_model()
    swap = BlockSwap(model, model.blocks, [2, 3, 4, 5], CPU, ring=2)
    slabs = {s.untyped_storage().data_ptr() for s in pins.slabs}
    hosts = [h for entries in swap._host.values() for *_, h in entries]
    assert pins.sizes and all(h.untyped_storage().data_ptr() in slabs for h in hosts)  # every copy in a slab
    assert sum(pins.sizes) == pinned.slab_bytes([h.nbytes for h in hosts])
    for _ in range(2):
        grads = step(model)
        assert grads.keys() == reference.keys() and all(torch.equal(grads[k], reference[k]) for k in reference)
    swap.remove()  # the blocks become ordinary host blocks on their slab views, values intact
    assert all(torch.equal(g, reference[k]) for k, g in step(model).items())


def test_offload_through_slab_buffers_gives_the_same_gradients_and_reuses_its_slabs(pins):
    reference = step(six_block_model())
    model = six_block_model()
    offload = ActivationOffload(CPU, "cpu", min_bytes=512)
    for forward in range(3):
        with offload.active():
            grads = step(model)
        assert all(torch.equal(grads[k], reference[k]) for k in reference)
        if forward == 0:
            assert pins.sizes == []  # the first forward: pageable buffers, its requests recorded
            planned = None
        elif forward == 1:
            planned = list(pins.sizes)
            assert planned and planned == offload._pool.slabs
        else:
            assert pins.sizes == planned  # the third forward reuses the second's slabs: nothing new pinned
    assert offload._pool._live == 0  # every buffer's place is free again once its step is over


def test_the_offload_pool_grows_to_the_larger_of_two_sizes_and_keeps_serving_the_smaller(pins, monkeypatch):
    released = []  # the pinned allocator is asked to give back the slabs a re-plan dropped (it caches freed blocks)
    monkeypatch.setattr(pinned, "_release_cached_pinned", lambda: released.append(len(pins.sizes)))
    pool = pinned.SlabPool("test")
    for sizes in ([4096] * 3, [8192] * 3 + [512], [4096] * 3, [8192] * 3 + [512]):
        pool.start()
        buffers = [pool.take((n,), torch.uint8) for n in sizes]
        del buffers
    first = pinned.slab_layout((4096,) * 3, pinned.OFFLOAD_SLAB_MAX).slabs
    second = pinned.slab_layout((8192,) * 3 + (512,), pinned.OFFLOAD_SLAB_MAX).slabs
    assert pins.sizes == [*first, *second]  # planned after the first and the second forward, never again
    assert released == [len(first)]  # once: when the second plan replaced the first's slabs, before its own


def test_a_failing_pin_falls_back_to_pageable_memory_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(pinned, "allocate_pinned", Recorder(fail=True))
    monkeypatch.setattr(pinned, "pinnable", lambda device: True)
    reference = step(six_block_model())
    model = six_block_model()
    originals = {p.data_ptr() for b in model.blocks[3:] for p in b.parameters() if not p.requires_grad}
    with caplog.at_level(logging.WARNING, logger="wantrain.memory"):
        swap = BlockSwap(model, model.blocks, [3, 4, 5], CPU)
        offload = ActivationOffload(CPU, "cpu", min_bytes=512)
        for _ in range(3):
            with offload.active():
                grads = step(model)
            assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert {h.data_ptr() for entries in swap._host.values() for *_, h in entries} == originals  # kept, pageable
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one for the swap, one for the offload, however many forwards ran
    assert warnings[0].startswith("block swap: pinning host memory failed (CUDA error: out of memory)")
    assert warnings[1].startswith("activation offload: pinning host memory failed") and "pageable" in warnings[1]


def test_waiting_copies_whose_pin_fails_stay_pageable_with_one_warning_and_the_experts_still_switch(monkeypatch,
                                                                                                    caplog):
    from tests.models.wan22_helpers import make_adapter
    from tests.simulated_device import DEVICE, MetaAsDevice

    failing = Recorder(fail=True)
    monkeypatch.setattr(pinned, "allocate_pinned", failing)
    monkeypatch.setattr(pinned, "pinnable", lambda device: True)
    with caplog.at_level(logging.WARNING, logger="wantrain.memory"), MetaAsDevice():
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1, rank=4,
                               base_dtype="fp32")
        adapter.activate("low_noise", None)
        adapter.activate("high_noise", None)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("the high-noise expert's waiting copy: pinning host memory "
                                                         "failed (CUDA error: out of memory)"), warnings
    assert not adapter.placement.pinned  # the second expert's copy was not tried: pageable from the first failure
    waiting = [copy for entries in adapter.placement._waiting.values() for _, _, copy, _ in entries]
    assert waiting and all(c.device.type == "cpu" for c in waiting)
    assert adapter.placement.resident() == ["high_noise"]
