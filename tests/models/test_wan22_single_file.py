"""Single-file checkpoints load with the dtypes of the folder path (issue 18.1): the modules diffusers keeps in
float32 (RoPE, time embedder, modulation tables, norm1-3) stay float32 under bf16, from fp32 and fp16 files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from wan22_helpers import raw_batch, single_file_pair, to_comfyui_keys

from wantrain.core.errors import UserError


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


def _low_noise_state(tiny_dir):
    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    return path, WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()


def _source(path, file, base_dtype="fp32"):
    from wantrain.models.wan22 import ModelConfig
    from wantrain.models.wan22.loading import WeightSource

    return WeightSource(ModelConfig(variant="tiny-t2v", path=str(path), low_noise_file=str(file),
                                    experts="low_noise", base_dtype=base_dtype), seed=0)


class _Float32Created(TorchDispatchMode):
    """Counts the elements of every float32 tensor an op creates on the CPU."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu":
                self.elements += t.numel()
        return out


def test_a_bf16_single_file_is_never_held_in_float32_outside_the_float32_modules(tiny_dir, tmp_path):
    path, state = _low_noise_state(tiny_dir)
    file = tmp_path / "low_bf16.safetensors"
    save_file(to_comfyui_keys({k: v.to(torch.bfloat16) for k, v in state.items()}), str(file))
    source = _source(path, file, "bf16")
    with _Float32Created() as created:
        transformer = source.transformer("low_noise", torch.bfloat16)
    kept = [t for t in [*transformer.parameters(), *transformer.buffers()] if t.dtype == torch.float32]
    everything = sum(t.numel() for t in [*transformer.parameters(), *transformer.buffers()])
    assert kept and sum(t.numel() for t in kept) < everything / 2
    # each float32 tensor is made once (its upcast, or RoPE's tables), never a float32 copy of the whole model
    assert created.elements <= 2 * sum(t.numel() for t in kept)


def _fp8_scaled_file(tiny_dir, tmp_path):
    """(the tiny pipeline folder, a ComfyUI fp8_scaled file of its low-noise expert, the real weights by file key,
    the original state)."""
    path, state = _low_noise_state(tiny_dir)
    scaled, expected = {}, {}
    for key, value in to_comfyui_keys(state).items():
        if value.dim() == 2 and key.endswith(".weight") and ".blocks." in key:  # ComfyUI scales the block Linears
            per_row = "ffn" in key  # one scale per output row for the FFN, one per tensor elsewhere
            scale = (value.abs().amax(dim=1, keepdim=True) if per_row else value.abs().max()) / 448.0
            weight = (value / scale).to(torch.float8_e4m3fn)
            scaled[key] = weight
            scaled[key[: -len(".weight")] + ".scale_weight"] = scale.reshape(-1) if per_row else scale.reshape(())
            scaled[key[: -len(".weight")] + ".scale_input"] = torch.ones(())
            expected[key] = weight.to(torch.float32) * scale
        else:
            scaled[key] = value
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    file = tmp_path / "low_fp8_scaled.safetensors"
    save_file(scaled, str(file))
    return path, file, expected, state


def test_an_fp8_scaled_file_loads_each_weight_times_its_scale(tiny_dir, tmp_path):
    path, file, expected, state = _fp8_scaled_file(tiny_dir, tmp_path)
    loaded = _source(path, file).transformer("low_noise", torch.float32).state_dict()
    q = loaded["blocks.0.attn1.to_q.weight"]
    assert torch.equal(q, expected["model.diffusion_model.blocks.0.self_attn.q.weight"])
    assert torch.equal(loaded["blocks.1.ffn.net.0.proj.weight"],
                       expected["model.diffusion_model.blocks.1.ffn.0.weight"])
    assert torch.allclose(q, state["blocks.0.attn1.to_q.weight"], rtol=0.07, atol=1e-6)  # the real weights


def test_an_fp8_scaled_file_with_plain_fp8_storage_is_refused_not_quantised_twice(tiny_dir, tmp_path):
    path, file, _, _ = _fp8_scaled_file(tiny_dir, tmp_path)
    with pytest.raises(UserError, match=r"is a ComfyUI fp8_scaled file: model\.base_dtype = 'fp8' .*quantised twice"
                       ) as err:
        _source(path, file, "fp8").transformer("low_noise", torch.bfloat16)
    assert "\n" not in str(err.value) and "base_dtype = 'fp8_scaled'" in str(err.value)


def test_fp8_scales_of_another_shape_are_refused_in_one_line(tiny_dir, tmp_path):
    path, state = _low_noise_state(tiny_dir)
    tensors = to_comfyui_keys(state)
    key = "model.diffusion_model.blocks.0.self_attn.q.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    tensors[key.replace(".weight", ".scale_weight")] = torch.ones(3, 8)  # per-block scales: not applied here
    file = tmp_path / "blockwise.safetensors"
    save_file(tensors, str(file))
    with pytest.raises(UserError, match=r"model\.low_noise_file .* fp8 scales of shape \(3, 8\)") as err:
        _source(path, file).transformer("low_noise", torch.float32)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_a_file_with_a_missing_or_an_unused_tensor_is_refused_in_one_line(tiny_dir, tmp_path, change):
    path, state = _low_noise_state(tiny_dir)
    tensors = to_comfyui_keys(state)
    if change == "missing":
        del tensors["model.diffusion_model.blocks.1.cross_attn.k.weight"]
        want = r"1 tensors of the model are not in the file, e.g. 'blocks\.1\.attn2\.to_k\.weight'"
    else:
        tensors["model.diffusion_model.blocks.0.extra_gate.weight"] = torch.zeros(4)
        want = r"1 tensors of the file are not in the model, e.g. 'model\.diffusion_model\.blocks\.0\.extra_gate"
    file = tmp_path / f"{change}.safetensors"
    save_file(tensors, str(file))
    with pytest.raises(UserError, match=rf"model\.low_noise_file .* does not fit the tiny-t2v transformer: {want}"
                       ) as err:
        _source(path, file).transformer("low_noise", torch.float32)
    assert "\n" not in str(err.value)
