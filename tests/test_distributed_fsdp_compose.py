"""Sharded weights with both experts and with DoRA (docs/distributed.md, "What composes"): two gloo ranks train the
tiny model's two experts, alternating every step, with DoRA adapters under ``model.parallel = "fsdp"``; data
parallel with the same draws is the reference. Both experts stay sharded on the device (1/2 of each per rank: nothing
alternates between the device and the host), and DoRA's export gathers each base weight's shards for its norm
(``adapter_types.DoRA.base_weight``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_distributed
from test_distributed import FSDP, FSDP_TOLERANCE, SHARDED, loras, only_run_dir, probe, torchrun, worst_relative

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

BOTH_DORA = ["--max-steps", "3", "--set", 'model.experts="both"', "--set", "model.switch_every=1",
             "--set", 'lora.type="dora"']


@pytest.fixture(scope="module")
def runs(workspace: Path) -> dict[str, Path]:
    out = {}
    for name, layout in (("both_dora_dp", []), ("both_dora_fsdp", SHARDED)):
        done = torchrun(workspace, name, *FSDP, *layout, *BOTH_DORA)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = only_run_dir(workspace / name)
    return out


def test_both_experts_with_dora_under_fsdp_equal_data_parallel(workspace, runs):
    sharded, reference = loras(runs["both_dora_fsdp"]), loras(runs["both_dora_dp"])
    assert sorted(sharded) == sorted(reference) == ["quickstart_high_noise.safetensors",
                                                    "quickstart_low_noise.safetensors"]
    for name, tensors in reference.items():
        assert any(k.endswith("dora_scale") for k in tensors)  # DoRA files, magnitude folded in as ComfyUI reads it
        assert worst_relative(sharded[name], tensors) <= FSDP_TOLERANCE, name
    record, _ = probe(workspace, "both_dora_fsdp", 0)
    assert [s[0] for s in record["steps"]] == [1, 2, 3] and record["status"] == "completed"
    held, whole = record["block_numel"]  # at the end: each rank held its rows of both experts' blocks
    assert abs(held - whole / 2) <= 0.05 * whole, record["block_numel"]
