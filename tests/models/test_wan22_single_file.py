"""Single-file checkpoints load with the dtypes of the folder path (issue 18.1): the modules diffusers keeps in
float32 (RoPE, time embedder, modulation tables, norm1-3) stay float32 under bf16, from fp32 and fp16 files."""

from __future__ import annotations

import pytest
import torch
from wan22_helpers import raw_batch, single_file_pair


def _dtypes(transformer) -> dict[str, torch.dtype]:
    tensors = [*transformer.named_parameters(), *transformer.named_buffers()]
    return {name.replace("base_layer.", ""): t.dtype for name, t in tensors if "lora_" not in name}


# modules diffusers keeps in float32 (``_keep_in_fp32_modules``); the tiny blocks' norm1/norm3 have no weights
_FP32_MODULES = ("rope.", "condition_embedder.time_embedder.", "scale_shift_table")


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.float16])
def test_single_file_has_the_folder_paths_dtypes(tiny_dir, tmp_path, monkeypatch, file_dtype, base_dtype):
    from wantrain.models.wan22 import adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))  # fp8 storage works on a CPU too
    folder, from_file = single_file_pair(tiny_dir, tmp_path, file_dtype, base_dtype=base_dtype)
    want = _dtypes(folder.transformer_for("low_noise"))
    got = _dtypes(from_file.transformer_for("low_noise"))
    assert got == want
    # what docs/models.md says about each dtype
    kept = {name for name, dtype in want.items() if dtype == torch.float32}
    assert kept == {name for name in want if name.startswith(_FP32_MODULES) or ".norm2." in name
                    or ".scale_shift_table" in name}
    linear = torch.float8_e4m3fn if base_dtype == "fp8" else torch.bfloat16
    assert want["blocks.0.attn1.to_q.weight"] == linear and want["blocks.0.ffn.net.2.weight"] == linear
    assert want["patch_embedding.weight"] == want["blocks.0.attn1.norm_q.weight"] == torch.bfloat16


def test_single_file_in_bf16_gives_the_folder_paths_loss(tiny_dir, tmp_path):
    folder, from_file = single_file_pair(tiny_dir, tmp_path, torch.float32, base_dtype="bf16")
    batch = folder.encode_batch(raw_batch(frames=5, size=32))
    losses = [a.loss(batch, "low_noise", torch.Generator().manual_seed(3)) for a in (folder, from_file)]
    assert losses[0].dtype == torch.float32
    assert torch.equal(losses[0], losses[1])
