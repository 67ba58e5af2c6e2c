"""The device-memory estimate against a fake-tensor trace of the real step, and the planner built on it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from wantrain.models.wan22.memory import GIB, MemorySettings, estimate, plan, weight_bytes

ROOT = Path(__file__).resolve().parents[2]


def trace_module():
    spec = importlib.util.spec_from_file_location("trace_memory", ROOT / "bench" / "trace_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("settings", [MemorySettings("bf16", 0, False), MemorySettings("fp8", 1, True)],
                         ids=lambda s: s.describe())
def test_the_estimate_is_within_ten_percent_of_a_traced_step_at_real_width(settings):
    # Two real-width A14B blocks (width 5120, FFN 13824) at 480x272x33 (4590 tokens): the activations and the
    # weights are of the same size here, so a wrong per-token constant or a wrong weight count both show.
    traced = trace_module().trace("t2v-a14b", settings.base_dtype, settings.blocks_to_swap,
                                  settings.offload_activations, (480, 272, 33), rank=32, layers=2)
    est = estimate("t2v-a14b", settings, width=480, height=272, frames=33, rank=32, layers=2)
    assert traced["tokens"] == 4590
    assert abs(est.allocated / GIB / traced["peak_gib"] - 1) < 0.10, (est.parts, traced)


def test_weights_are_counted_per_tensor_in_the_dtypes_a_run_gives_them():
    rest, blocks = weight_bytes("t2v-a14b", "bf16")
    rest8, blocks8 = weight_bytes("t2v-a14b", "fp8")
    assert len(blocks) == 40 and len(set(blocks)) == 1
    # 14.3e9 parameters, mostly bf16; fp8 halves the Linears of the blocks only (norms, modulation stay)
    assert 26.0 < (rest + sum(blocks)) / GIB < 28.0
    assert 0.49 < blocks8[0] / blocks[0] < 0.52 and rest8 == rest


def test_the_planner_fits_a14b_480p_in_24_gib_moving_the_fewest_bytes_over_the_host_link():
    chosen, smallest = plan("t2v-a14b", 24.0, base_dtype="auto", width=832, height=480, frames=81, rank=32)
    assert chosen is not None and chosen.device_gib <= 24.0
    for swap in range(41):  # every other bf16/fp8 setting that fits moves at least as many bytes
        for offload in (False, True):
            for dtype in ("bf16", "fp8"):
                other = estimate("t2v-a14b", MemorySettings(dtype, swap, offload), width=832, height=480,
                                 frames=81, rank=32)
                if other.device_gib <= 24.0 and dtype == chosen.settings.base_dtype:
                    assert other.link_bytes >= chosen.link_bytes
    assert smallest.device_gib <= chosen.device_gib


def test_a_budget_nothing_fits_has_no_plan_and_names_the_smallest_setting():
    chosen, smallest = plan("t2v-a14b", 10.0, base_dtype="auto", width=1280, height=720, frames=81, rank=32)
    assert chosen is None
    assert smallest.settings == MemorySettings("fp8", 40, True)
