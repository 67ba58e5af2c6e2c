"""Experts stream from disk into their storage dtype tensor by tensor (issue 24.4), whatever holds them: a single
file, the original repos' folder of shards with an index, or a diffusers folder. Never a float32 copy of a bf16
expert, never a bf16 copy of an fp8 one; the result is what diffusers' own loaders give."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_wan22_model_files import write_shards
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from wan22_helpers import to_comfyui_keys

from wantrain.models.wan22 import ModelConfig
from wantrain.models.wan22.loading import WeightSource


class _LiveBytes(TorchDispatchMode):
    """The peak of the live bytes of the CPU tensors of ``dtype`` that ops create (polled at every op; a storage
    counts until it is freed)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.created = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.live:
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                    self.created += t.numel()
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _state(tiny_dir):
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    return path, WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()


def _expert_source(tiny_dir, tmp_path, layout: str, base_dtype: str, file_dtype=torch.float32):
    """A WeightSource of tiny-t2v's low-noise expert held as ``layout``."""
    path, state = _state(tiny_dir)
    state = {k: v.to(file_dtype) for k, v in state.items()}
    model = dict(variant="tiny-t2v", path=str(path), experts="low_noise", base_dtype=base_dtype)
    if layout == "single_file":
        file = tmp_path / "low.safetensors"
        save_file(to_comfyui_keys(state), str(file))
        model["low_noise_file"] = str(file)
    elif layout == "shards":
        model["low_noise_file"] = str(write_shards(to_comfyui_keys(state), tmp_path / "low_noise_model", parts=3))
    return WeightSource(ModelConfig(**model), seed=0)


def test_a_diffusers_folder_streams_into_what_from_pretrained_gives(tiny_dir):
    from diffusers import WanTransformer3DModel

    path, _ = _state(tiny_dir)
    source = WeightSource(ModelConfig(variant="tiny-t2v", path=str(path), experts="low_noise"), seed=0)
    want = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2", torch_dtype=torch.bfloat16,
                                                 local_files_only=True)
    got = source.transformer("low_noise", torch.bfloat16)
    a = {**dict(want.named_parameters()), **dict(want.named_buffers())}
    b = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert {t.dtype for t in b.values()} == {torch.bfloat16, torch.float32}  # the fp32 modules stay fp32


def test_a_bf16_sharded_folder_is_never_held_in_float32_outside_the_float32_modules(tiny_dir, tmp_path):
    source = _expert_source(tiny_dir, tmp_path, "shards", "bf16", file_dtype=torch.bfloat16)
    with _LiveBytes(torch.float32) as fp32:
        transformer = source.transformer("low_noise", torch.bfloat16)
    tensors = [*transformer.parameters(), *transformer.buffers()]
    kept = sum(t.numel() for t in tensors if t.dtype == torch.float32)
    assert 0 < kept < sum(t.numel() for t in tensors) / 2
    # each float32 tensor is made once (its upcast, or RoPE's tables), never a float32 copy of the whole model
    assert fp32.created <= 2 * kept


@pytest.mark.parametrize("layout", ["single_file", "shards", "diffusers_folder"])
def test_an_fp8_expert_is_never_held_in_bf16_while_it_loads(tiny_dir, tmp_path, layout):
    from diffusers import WanTransformer3DModel

    source = _expert_source(tiny_dir, tmp_path, layout, "fp8")
    with _LiveBytes(torch.bfloat16) as bf16:
        transformer = source.transformer("low_noise", torch.bfloat16)
    tensors = [*transformer.parameters(), *transformer.buffers()]
    block = transformer.blocks[1]  # the block Linears arrive in float8
    assert {block.attn1.to_q.weight.dtype, block.attn2.to_v.weight.dtype, block.ffn.net[2].weight.dtype} == {
        torch.float8_e4m3fn}
    kept = sum(t.numel() * 2 for t in tensors if t.dtype == torch.bfloat16)
    largest = max(t.numel() * 2 for t in tensors)
    assert bf16.peak <= kept + largest  # one tensor in flight in bf16, never the expert
    # and the result is the folder path's: bf16 weights stored in float8 by diffusers' layerwise casting
    reference = WanTransformer3DModel.from_pretrained(str(tiny_dir("tiny-t2v")), subfolder="transformer_2",
                                                      torch_dtype=torch.bfloat16, local_files_only=True)
    for model in (reference, transformer):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    a, b = reference.state_dict(), transformer.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8)
                                        if a[k].dtype == torch.float8_e4m3fn else a[k], b[k].view(torch.uint8)
                                        if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)
