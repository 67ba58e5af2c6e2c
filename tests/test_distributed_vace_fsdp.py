"""FSDP of a VACE expert (``model.parallel = "fsdp"``, ``app.assemble.shard_experts``, docs/models.md "Control"): two
gloo ranks under torchrun build the tiny VACE twin as ``wantrain run`` does (rank 0 loads it whole, rank 1 on
``meta``; every block, each VACE block too, an FSDP unit of its own filled from rank 0) and train two AdamW steps on
a global batch of two samples with control contexts, one per rank (tests/fsdp_vace_twin.py): the LoRA, the VACE
blocks' included, is one process's within float32's bounds (tests/float32_bounds.py)."""

from __future__ import annotations

import json

import float32_bounds
import pytest
from fsdp_vace_twin import LR, STEPS, train
from safetensors.torch import load_file
from test_distributed import torchrun_script

pytestmark = pytest.mark.slow


def test_a_sharded_vace_expert_trains_the_one_process_lora_with_each_vace_block_a_unit_of_its_own(tmp_path):
    done = torchrun_script("fsdp_vace_twin.py", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in (0, 1):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["units"] == [True] * 4  # 2 VACE + 2 main
    sharded = load_file(str(tmp_path / "lora.safetensors"))
    _, whole = train(None, 1)
    assert sorted(sharded) == sorted(whole)
    vace_b = [k for k in whole if k.startswith("vace_blocks.") and ".lora_B." in k]
    assert len(vace_b) == 23 and all(whole[k].abs().max() > 0 for k in vace_b)  # the VACE LoRA trained
    assert float32_bounds.largest_difference(sharded, whole) <= float32_bounds.adamw_drift(STEPS, LR)
