"""UMT5 from a safetensors file is streamed into its compute dtype: the host never holds the file's copy and the cast
copy of the encoder at once (2 x 10.6 GiB for UMT5-XXL from ``umt5_xxl_fp16.safetensors``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
_CHILD = r"""
import json, sys, torch
from wantrain.models.wan22 import single_file
from wantrain.models.wan22.text_file import load_text_encoder

def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

single_file._REOPEN_BYTES = 4 << 20  # a window small against this file, as 256 MiB is against UMT5-XXL's 11 GB
load_text_encoder(sys.argv[2], torch.bfloat16)  # warm up: lazy imports and first-call allocations are not the load
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
model = load_text_encoder(sys.argv[1], torch.bfloat16)
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak": status("VmHWM") - base, "model": size, "tied": model.encoder.embed_tokens.weight is
                  model.shared.weight, "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
"""


def _umt5_file(path: Path, **sizes) -> Path:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(**sizes, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    state = UMT5EncoderModel(config).to(torch.float16).state_dict()
    save_file({k: v.contiguous() for k, v in state.items() if k != "encoder.embed_tokens.weight"}, path)
    return path


def test_an_fp16_umt5_file_loads_into_bf16_without_a_second_copy(tmp_path):
    file = _umt5_file(tmp_path / "umt5_fp16.safetensors", vocab_size=32000, d_model=512, d_kv=64, d_ff=1024,
                      num_layers=8, num_heads=8)
    warm = _umt5_file(tmp_path / "warm.safetensors", vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                      num_heads=4)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(file), str(warm)], env=env, capture_output=True,
                          text=True, check=True, timeout=300)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    encoder = file.stat().st_size  # fp16 -> bf16: the encoder's bytes
    embedding = 32000 * 512 * 2  # the largest tensor
    assert out["dtypes"] == ["torch.bfloat16"] and out["tied"] and abs(out["model"] / encoder - 1) < 0.01
    # the encoder once, plus one tensor's pages and the 4 MiB window (8 MiB slack); reading the file whole and then
    # casting holds both copies (2x)
    assert out["peak"] <= encoder + embedding + 12 * 2**20, out
