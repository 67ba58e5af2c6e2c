"""GPU check of issue 18.1: on CUDA, one bf16 training step of a tiny model loaded from a single file equals the
folder path's step (same loss, same updated LoRA). Skips without a CUDA GPU; the CPU dtype and loss parity is in
test_wan22_single_file.py. Run with ``-s`` to read the two losses."""

from __future__ import annotations

import pytest
import torch
from wan22_helpers import raw_batch, single_file_pair

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_single_file_bf16_step_on_cuda_equals_the_folder_paths(tiny_dir, tmp_path):
    device = torch.device("cuda")
    pair = single_file_pair(tiny_dir, tmp_path, torch.float32, base_dtype="bf16", device=device, alpha=2)
    batch = pair[0].encode_batch(raw_batch(frames=9, size=64))
    losses, loras = [], []
    for adapter in pair:
        adapter.release_encoders()
        with torch.no_grad():  # a non-zero LoRA B, so that the step depends on every base weight
            for p in adapter.trainable_parameters("low_noise"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p) * 1e-2)
        optimizer = torch.optim.AdamW(adapter.param_groups(), weight_decay=0.0)
        adapter.activate("low_noise", optimizer)
        loss = adapter.loss(batch, "low_noise", torch.Generator(device=device).manual_seed(0))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        loras.append([p.detach().clone() for p in adapter.trainable_parameters("low_noise")])
    print(f"\nbf16 on CUDA, loss: folder {losses[0].item():.7f}, single file {losses[1].item():.7f}")
    assert torch.equal(losses[0], losses[1])
    # the forward is bit-equal; attention backward kernels may sum in a different order from run to run
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(*loras, strict=True))
