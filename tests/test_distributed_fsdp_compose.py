"""Sharded weights with both experts, with DoRA and with the alpha schedule (docs/distributed.md, "What composes"):
two gloo ranks train under ``model.parallel = "fsdp"``; data parallel with the same draws is the reference.

* The tiny model's two experts, alternating every step, with DoRA adapters: both experts stay sharded on the device
  (1/2 of each per rank: nothing alternates between the device and the host), and DoRA's export gathers each base
  weight's shards for its norm (``adapter_types.DoRA.base_weight``).
* ``lora.alpha_schedule`` with a phase that ends at step 4: the gradient sign agreement counts each rank's rows and
  sums the counts over the ranks (``observers.alpha.stats.SignAgreement``), so the controller sees data parallel's
  statistics and moves to the next alpha at the same step."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_distributed
from test_distributed import (
    FSDP,
    FSDP_TOLERANCE,
    SHARDED,
    loras,
    metrics,
    only_run_dir,
    probe,
    torchrun,
    worst_relative,
)

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

BOTH_DORA = ["--max-steps", "3", "--set", 'model.experts="both"', "--set", "model.switch_every=1",
             "--set", 'lora.type="dora"']


SCHEDULE = ["--max-steps", "7", "--set", "train.log_every=1", "--set",
            'lora.alpha_schedule={enabled=true, window=4, min_samples=3, phases=[{name="a", alpha=4, min_steps=3, '
            'loss_improvement_rate_below=1000.0, max_loss_cv=10.0, min_gradient_stability=0.0}, {name="b", alpha=8}]}']


def launch(workspace: Path, name: str, *settings: str) -> dict[str, Path]:
    """The data-parallel reference and the fsdp run of ``settings``, by layout."""
    out = {}
    for layout, extra in (("dp", []), ("fsdp", SHARDED)):
        done = torchrun(workspace, f"{name}_{layout}", *FSDP, *extra, *settings)
        assert done.returncode == 0, done.stderr[-3000:]
        out[layout] = only_run_dir(workspace / f"{name}_{layout}")
    return out


@pytest.fixture(scope="module")
def runs(workspace: Path) -> dict[str, Path]:
    out = launch(workspace, "both_dora", *BOTH_DORA)
    return {"both_dora_dp": out["dp"], "both_dora_fsdp": out["fsdp"]}


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


def test_the_alpha_schedule_under_fsdp_decides_as_data_parallel(workspace):
    runs = launch(workspace, "alpha", *SCHEDULE)
    rows = {layout: metrics(run_dir) for layout, run_dir in runs.items()}
    stability = {layout: [r["alpha/gradient_stability/high_noise"] for r in rows[layout][1:]] for layout in rows}
    assert all(v is not None for v in stability["fsdp"]) and stability["fsdp"] == pytest.approx(
        stability["dp"], rel=FSDP_TOLERANCE)  # every rank's rows counted, once
    alphas = {layout: [r["alpha/linear_alpha/high_noise"] for r in rows[layout]] for layout in rows}
    assert alphas["fsdp"] == alphas["dp"] == [4.0] * 4 + [8.0] * 3  # the next phase at the same step
    name = "quickstart_high_noise.safetensors"
    assert worst_relative(loras(runs["fsdp"])[name], loras(runs["dp"])[name]) <= FSDP_TOLERANCE
