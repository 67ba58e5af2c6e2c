"""Ulysses sequence parallelism of a VACE transformer (``wantrain.models.wan22.sequence.vace_cp_plan``,
docs/models.md "Control"): two gloo ranks under torchrun split the tiny VACE twin's video and control tokens
(tests/ulysses_vace_twin.py); the loss and the LoRA gradients, the VACE blocks' included, equal one process's within
float32's bounds (tests/float32_bounds.py)."""

from __future__ import annotations

import float32_bounds
import pytest
from safetensors.torch import load_file
from test_distributed import torchrun_script
from ulysses_vace_twin import loss_and_gradients

pytestmark = pytest.mark.slow


def test_ulysses_degree_2_splits_the_vace_blocks_and_gives_the_one_process_loss_and_gradients(tmp_path):
    done = torchrun_script("ulysses_vace_twin.py", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    split = load_file(str(tmp_path / "ulysses_vace.safetensors"))
    whole = loss_and_gradients(1)
    assert sorted(split) == sorted(whole)
    vace = [k for k in whole if k.startswith("vace_blocks.")]
    assert len(vace) == 2 * 23 and all(whole[k].abs().max() > 0 for k in vace)  # every VACE LoRA has a gradient
    assert float((split["loss"] - whole["loss"]).abs()) <= float32_bounds.LOSS * float(whole["loss"].abs())
    for key, value in whole.items():
        assert float((split[key] - value).abs().max()) <= float32_bounds.GRAD * float(value.abs().max()), key


def test_a_vace_variant_takes_a_sequence_degree_and_fsdp():
    from wantrain.models.wan22 import ModelConfig, control

    for keys in (dict(sequence_degree=2), dict(parallel="fsdp", experts="high_noise"),
                 dict(parallel="fsdp", experts="low_noise", sequence_degree=2)):
        assert control.problems(ModelConfig(variant="tiny-vace-t2v", **keys)) == []
