"""bitsandbytes' 8-bit step synchronises the device after every parameter it steps (docs/optimizers.md, note 4):
counted here on the CPU (where the call is a no-op) by wrapping the function it calls."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models.wan22_helpers import make_adapter, raw_batch
from wantrain.optimizers import OptimizerConfig, build_optimizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"


def test_adamw8bit_synchronises_once_per_parameter_it_steps_as_the_docs_say(monkeypatch):
    import bitsandbytes.optim.optimizer as bnb_optimizer  # in the test extra

    calls = []
    real = bnb_optimizer.sync_gpu
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda p: (calls.append(p), real(p)))
    adapter = make_adapter("tiny-t2v", experts="high_noise")
    optimizer = build_optimizer(OptimizerConfig(type="adamw8bit", arguments={"min_8bit_size": 16}),
                                adapter.param_groups(), torch.device("cpu"))
    batch = adapter.encode_batch(raw_batch())
    adapter.loss(batch, "high_noise", torch.Generator().manual_seed(0)).backward()
    with_grad = [p for p in adapter.trainable_parameters() if p.grad is not None]
    optimizer.step()
    assert len(with_grad) == 40 and len(calls) == len(with_grad)  # one per LoRA tensor: 800 on an A14B expert
    text = DOC.read_text()
    assert "synchronises the device after **every parameter**" in text and "800 per" in text
