"""The host-memory estimate (``memory.host_estimate``, ``wantrain check``'s "host memory" lines) against what a run
keeps on the host, and the A14B figures it gives.

A tiny model's tensors (kilobytes) are far below the noise of a process's RSS (tens of megabytes from the
allocator and imports alone), so the check here is exact instead: on a CPU-only machine ``meta`` plays the GPU
(tests/simulated_device.py) and every byte of every tensor the run holds on the host is counted, storage by storage,
after a step and an expert switch. The RSS of loading at real width is bench/bench_single_file_load.py's.
"""

from __future__ import annotations

import pytest
import torch
from test_expert_placement import _with_state
from wan22_helpers import make_adapter

from tests.models.test_memory_plan import a14b_config
from tests.simulated_device import DEVICE, MetaAsDevice
from wantrain.models.wan22 import pinned
from wantrain.models.wan22.memory import GIB, MemorySettings, host_estimate


def _host_bytes(adapter, optimizer) -> int:
    """Bytes of the distinct CPU storages the run holds: both experts' tensors and the placement's waiting copies,
    the swap's host copies, the optimizer state."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for expert in adapter.experts:
        transformer = adapter.transformer_for(expert)
        for t in [*transformer.parameters(), *transformer.buffers()]:
            add(t)
            add(t.grad)
        swap = adapter._swaps.get(expert)
        for entries in (swap._host.values() if swap is not None else ()):
            for *_, host in entries:
                add(host)
    for entries in adapter.placement._waiting.values():  # the waiting copies (also the training expert's)
        for *_, copy, _ in entries:
            add(copy)
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step":  # AdamW's 4-byte step counters (2 per LoRA layer): not counted by the estimate
                add(value)
    return sum(seen.values())


@pytest.mark.parametrize("swap", [0, 1])
def test_the_host_estimate_covers_every_byte_a_two_expert_run_keeps_on_the_host(swap):
    with MetaAsDevice():
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1, rank=4,
                               blocks_to_swap=swap, base_dtype="fp32")
        optimizer = _with_state(adapter)
        # as after a step of each expert: LoRA and AdamW state, no gradient (the loop sets them to None after every
        # step: tests/models/test_waiting_on_disk.py)
        adapter.activate("low_noise", optimizer)  # the high-noise expert waits on the host with all of it
        measured = _host_bytes(adapter, optimizer)
    est = host_estimate("tiny-t2v", MemorySettings("fp32", swap, False), experts=("high_noise", "low_noise"),
                        rank=4, width=32, height=32, frames=5, cuda=False)
    counted = sum(v for k, v in est.parts.items() if "host copy" in k or "waiting expert" in k)
    assert counted == measured, (measured, est.parts)  # every byte, no more


@pytest.mark.parametrize("swap", [0, 1])
def test_the_host_estimate_counts_the_pinned_slabs_a_two_expert_run_carves_byte_for_byte(swap, monkeypatch):
    """As above, training "on CUDA" (the simulated device, with pinning said to be possible and the pin function
    handing out ordinary host memory): the swap's copies and the waiting copies are carved from slabs, and the
    distinct CPU storages are the slabs, their unused ends included, plus what is never pinned."""
    slabs: list[int] = []

    def allocate(nbytes):
        slabs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pinned, "allocate_pinned", allocate)
    monkeypatch.setattr(pinned, "pinnable", lambda device: True)
    with MetaAsDevice():
        adapter = make_adapter("tiny-t2v", device=DEVICE, offload_device="cpu", switch_every=1, rank=4,
                               blocks_to_swap=swap, base_dtype="fp32")
        optimizer = _with_state(adapter)
        adapter.activate("low_noise", optimizer)
        measured = _host_bytes(adapter, optimizer)
    est = host_estimate("tiny-t2v", MemorySettings("fp32", swap, False), experts=("high_noise", "low_noise"),
                        rank=4, width=32, height=32, frames=5, cuda=True, pin_budget=GIB)
    assert est.pinned == "swap and waiting copies pinned" and slabs
    counted = sum(v for k, v in est.parts.items() if "host copy" in k or "waiting expert" in k or "slabs" in k)
    assert est.parts["pinned slabs' unused ends"] > 0
    assert counted == measured, (measured, est.parts)


def test_a_both_experts_fp8_a14b_run_with_swap_fits_64_gb_of_host_memory():
    est = host_estimate("t2v-a14b", MemorySettings("fp8", 20, False), experts=("high_noise", "low_noise"),
                        rank=32, width=832, height=480, frames=81, cuda=True, pin_budget=32 * GIB)
    copies = [v for k, v in est.parts.items() if "host copy (fp8)" in k]
    assert len(copies) == 2 and all(13.0 < c / GIB < 14.0 for c in copies)  # 14.3e9 params, block Linears in fp8
    assert est.peak_phase == "while loading" and est.peak <= 64e9  # the encoders were released before the experts
    # the pinned copies are carved from power-of-two slabs: their unused ends, not +53 % of per-tensor rounding
    assert 0 < est.parts["pinned slabs' unused ends"] / sum(copies) < 0.03
    assert pinned.pow2_ceil(5120 * 13824) == 128 * 2**20 and pinned.pow2_ceil(2**20) == 2**20


def test_check_prints_the_host_memory_part_by_part(tmp_path, capsys, monkeypatch):
    from wantrain.cli.main import main

    monkeypatch.setattr("wantrain.app.preflight.check_model_files", lambda model, **_: None)  # no A14B weights here

    monkeypatch.setattr("wantrain.app.preflight.missing_model_files", lambda model: [])
    config = a14b_config(tmp_path, 24)
    config.write_text(config.read_text().replace("vram_budget_gb = 24", 'base_dtype = "fp8"\nblocks_to_swap = 20'))
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "host memory (RAM), part by part" in out
    for part in ("high-noise expert host copy (fp8)", "low-noise expert host copy (fp8)", "pinned slabs' unused ends",
                 "waiting expert's LoRA + AdamW", "text encoder (UMT5) (while the cache fills)",
                 "total while training", "largest part:"):
        assert part in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned host memory)")
def test_pinning_a_tensor_takes_the_next_power_of_two_and_a_slab_of_a_power_of_two_exactly():
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    tensor = torch.empty(3 * 2**20 + 1, dtype=torch.uint8).pin_memory()
    after = torch.cuda.memory.host_memory_stats()["allocated_bytes.current"]
    assert after - before == pinned.pow2_ceil(tensor.numel()) == 4 * 2**20
    slab = pinned.allocate_pinned(2**22)
    assert torch.cuda.memory.host_memory_stats()["allocated_bytes.current"] - after == 2**22 and slab.is_pinned()


def test_sampling_with_one_trained_a14b_expert_counts_the_other_experts_host_copy():
    settings = MemorySettings("fp8", 0, False)
    size = dict(rank=32, width=832, height=480, frames=81, cuda=False)
    alone = host_estimate("t2v-a14b", settings, experts=("low_noise",), **size)
    sampling = host_estimate("t2v-a14b", settings, experts=("low_noise",), sampling_only=("high_noise",), **size)
    assert not any("host copy" in k for k in alone.parts)  # one expert, no swap: it lives on the device
    copies = [k for k in sampling.parts if "host copy" in k]
    assert copies == ["low-noise expert host copy (fp8)", "high-noise expert host copy (fp8, sampling only)"]
    assert "waiting expert's LoRA + AdamW" not in sampling.parts  # a frozen expert has no LoRA state


def test_the_cache_phase_holds_the_encoders_alone_when_they_are_released_before_the_experts_load():
    """One process fills the cache before the experts load (tests/test_encoders_before_experts.py): that phase holds
    the runtime and the encoders only; torchrun fills it after them, on top of every part (the old order)."""
    from wantrain.models.wan22.memory import RUNTIME_PART, encoder_bytes

    size = dict(experts=("high_noise", "low_noise"), rank=32, width=832, height=480, frames=81, cuda=True,
                pin_budget=32 * GIB)
    first = host_estimate("t2v-a14b", MemorySettings("fp8", 20, False), **size)
    after = host_estimate("t2v-a14b", MemorySettings("fp8", 20, False), encoders_first=False, **size)
    text, vae = encoder_bytes("t2v-a14b", "bf16")
    assert list(first.phases) == ["while the cache fills", "while loading", "while training"]
    assert first.phase_total("while the cache fills") == first.parts[RUNTIME_PART] + text + vae
    assert list(after.phases) == ["while loading", "while the cache fills", "while training"]
    assert after.phase_total("while the cache fills") == sum(after.parts.values()) + text + vae
    assert first.peak < after.peak and after.peak_phase == "while the cache fills"
    assert first.lines()[-1] == ("  order: the cache fills with the encoders alone (released after), then the experts "
                                 "load, then training")
    assert after.lines()[-1].startswith("  order: the experts load, then the cache fills beside them")
    none = host_estimate("t2v-a14b", MemorySettings("fp8", 20, False), encoders=False, **size)
    assert "while the cache fills" not in none.phases and "no encoder loads" in none.order
