"""GPU check of issue 3: the tiny variants train in bf16 and with fp8 weight storage on CUDA.

Prints step time and peak VRAM (run with ``-s`` on a GPU machine to read them). Skips without a CUDA GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
from wan22_helpers import raw_batch

from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("variant", ["tiny-t2v", "tiny-i2v", "tiny-ti2v"])
def test_tiny_variant_trains_on_cuda(variant, base_dtype):
    device = torch.device("cuda")
    adapter = build_adapter(ModelConfig(variant=variant, base_dtype=base_dtype), LoraConfig(rank=4, alpha=2),
                            seed=0, device=device, base_lr=1e-2)
    batch = {**adapter.encode_media(raw_batch(frames=9, size=64)["pixels"].to(device)),
             **adapter.encode_text(["a red ball bouncing on the grass"])}
    adapter.release_encoders()
    optimizer = torch.optim.AdamW(adapter.param_groups(), weight_decay=0.0)
    generator = torch.Generator(device=device).manual_seed(0)
    expert = adapter.expert_for_step(1)
    adapter.activate(expert, optimizer)
    before = [p.detach().clone() for p in adapter.trainable_parameters(expert)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, start = [], time.perf_counter()
    for _ in range(5):
        loss = adapter.loss(batch, expert, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / 5 * 1000
    peak_mib = torch.cuda.max_memory_allocated() / 2**20
    print(f"\n{variant} {base_dtype}: {step_ms:.1f} ms/step, peak VRAM {peak_mib:.1f} MiB")
    assert torch.isfinite(torch.stack(losses)).all()
    after = adapter.trainable_parameters(expert)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in after)  # LoRA trains in fp32
    for other in adapter.experts:
        if other != expert:
            assert adapter.placement.where[other] != device
