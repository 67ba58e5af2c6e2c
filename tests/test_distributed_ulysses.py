"""Ulysses sequence parallelism (``wantrain.models.wan22.sequence``, docs/distributed.md): two gloo ranks under
torchrun split the tiny TI2V twin's tokens through diffusers' ``ContextParallelConfig(ulysses_degree=2)``
(tests/ulysses_twin.py); the loss and the LoRA gradients equal one process's."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from test_distributed import torchrun_script
from ulysses_twin import loss_and_gradients

pytestmark = pytest.mark.slow

RELATIVE_TOLERANCE = 1e-6
"""Of the loss and of each gradient, max |a - b| / max |b|, fp32 (measured: the loss equal, the gradients 1.7e-7:
the attention sums its heads' and the gradients their tokens' contributions in another order)."""


def test_ulysses_degree_2_gives_the_one_process_loss_and_gradients(tmp_path):
    done = torchrun_script("ulysses_twin.py", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    split = load_file(str(tmp_path / "ulysses.safetensors"))
    whole = loss_and_gradients(1)
    assert sorted(split) == sorted(whole) and len(whole) > 1
    assert any(".lora_B." in k and whole[k].abs().max() > 0 for k in whole)  # gradients that mean something
    for key, value in whole.items():
        assert float((split[key] - value).abs().max()) <= RELATIVE_TOLERANCE * float(value.abs().max()), key
