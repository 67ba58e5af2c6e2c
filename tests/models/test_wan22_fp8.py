"""Scaled fp8 storage of the frozen base (``model.base_dtype = "fp8_scaled"``, ``models/wan22/fp8.py``): less
error than the plain fp8 cast, float8 weights with per-row scales in memory (a ComfyUI ``fp8_scaled`` file keeps its
own), LoRA on top of the dequantised base, and the gradient checkpointing rule of fp8 storage."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from wan22_helpers import make_adapter, raw_batch, to_comfyui_keys, train_steps

from wantrain.core.errors import ConfigError, UserError
from wantrain.models.wan22 import ModelConfig, fp8

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """fp8 storage works on a CPU too; runs refuse it there only because it is not worth its cost."""
    from wantrain.models.wan22 import adapter as adapter_module

    monkeypatch.setattr(adapter_module, "FP8_DEVICE_TYPES", ("cuda", "cpu"))


class _OneBlock(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"proj": linear})])


def _channel_errors(y: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """||y - reference|| / ||reference|| of each output channel (column) of a [tokens, out] output."""
    return (y.float() - reference).norm(dim=0) / reference.norm(dim=0)


def test_scaled_fp8_has_less_output_error_than_the_plain_cast_on_a_layer_with_outlier_rows():
    """Most output channels of Wan-sized weights (std 0.004: mostly E4M3 subnormals when cast as they are) and a
    few outlier channels 100x larger: one scale per row gives every channel E4M3's whole range; the plain cast keeps
    precision only where the values are large."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g) * 0.004
    outliers = torch.zeros(64, dtype=torch.bool)
    outliers[::16] = True
    weight[outliers] *= 100.0
    x = torch.randn(32, 256, generator=g).to(torch.bfloat16)
    reference = x.float() @ weight.T

    plain = nn.Linear(256, 64, bias=False)
    plain.weight.data = weight.to(torch.bfloat16)
    from diffusers.hooks import apply_layerwise_casting  # what base_dtype = "fp8" does

    apply_layerwise_casting(plain, storage_dtype=E4M3, compute_dtype=torch.bfloat16, skip_modules_pattern=None)
    assert plain.weight.dtype == E4M3
    scaled_model = _OneBlock(nn.Linear(256, 64, bias=False))
    scaled_model.blocks[0]["proj"].weight.data = weight.to(torch.bfloat16)
    scaled = fp8.to_scaled_fp8(scaled_model).blocks[0]["proj"]
    assert isinstance(scaled, fp8.ScaledFp8Linear) and scaled.weight.dtype == E4M3
    assert scaled.weight_scale.dtype == torch.float32 and scaled.weight_scale.shape == (64, 1)

    with torch.no_grad():
        plain_errors = _channel_errors(plain(x), reference)
        scaled_errors = _channel_errors(scaled(x), reference)
    assert scaled_errors.max() < 0.05  # E4M3's 3 mantissa bits: a few percent in every channel
    assert scaled_errors.mean() < plain_errors.mean() / 3
    assert plain_errors[~outliers].min() > 0.08  # where the plain cast loses precision: the small channels
    assert scaled_errors[outliers].mean() < 1.2 * plain_errors[outliers].mean()  # and no worse on the outliers


def test_a_row_is_stored_as_its_absmax_over_448_and_dequantises_within_e4m3_rounding():
    weight = torch.tensor([[0.001, -0.002, 0.0005], [3.0, -1.5, 0.25], [0.0, 0.0, 0.0]])
    q, scale = fp8.quantise_rows(weight)
    assert torch.equal(scale[:, 0], torch.tensor([0.002, 3.0, 448.0]) / 448)  # float32 arithmetic, as stored
    assert q.dtype == E4M3 and q.float().abs().amax(dim=1).tolist() == [448.0, 448.0, 0.0]
    back = fp8.dequantise(q, scale, torch.float32)
    assert torch.allclose(back, weight, rtol=2**-4, atol=0)


def test_scaled_fp8_stores_float8_with_scales_and_trains_a_fp32_lora_on_top(fp8_on_cpu):
    scaled = make_adapter("tiny-t2v", base_dtype="fp8_scaled", experts="high_noise")
    bf16 = make_adapter("tiny-t2v", base_dtype="bf16", experts="high_noise")
    plain = make_adapter("tiny-t2v", base_dtype="fp8", experts="high_noise")
    transformer = scaled.transformer_for("high_noise")
    base_layers = [m.base_layer for m in transformer.modules() if hasattr(m, "base_layer")]
    assert len(base_layers) == 10 * len(transformer.blocks)
    assert all(isinstance(b, fp8.ScaledFp8Linear) and b.weight.dtype == E4M3 and b.bias.dtype == torch.bfloat16
               for b in base_layers)
    assert {p.dtype for p in scaled.trainable_parameters()} == {torch.float32}
    batch = bf16.encode_batch(raw_batch())
    losses = {name: a.loss(batch, "high_noise", torch.Generator().manual_seed(3)).item()
              for name, a in (("scaled", scaled), ("bf16", bf16), ("plain", plain))}
    assert abs(losses["scaled"] - losses["bf16"]) < abs(losses["plain"] - losses["bf16"])
    before = [p.detach().clone() for p in scaled.trainable_parameters()]
    train_steps(scaled, batch, steps=2, lr=1e-2)
    after = scaled.trainable_parameters()
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.isfinite(p).all() for p in after)
    assert all(b.weight.dtype == E4M3 for b in base_layers)  # the base never changes


def test_scaled_fp8_on_a_cpu_is_a_one_line_error():
    with pytest.raises(UserError, match="base_dtype = 'fp8_scaled' needs a CUDA device") as err:
        make_adapter("tiny-t2v", base_dtype="fp8_scaled")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("base_dtype", ["fp8", "fp8_scaled"])
def test_fp8_storage_without_gradient_checkpointing_is_refused_in_one_line(base_dtype):
    with pytest.raises(ConfigError, match=rf"base_dtype = '{base_dtype}' with model\.gradient_checkpointing = "
                                          "false keeps a bf16 copy"):
        ModelConfig(variant="t2v-a14b", base_dtype=base_dtype, gradient_checkpointing=False)


def _saved_dequantised_weights(transformer: nn.Module) -> int:
    """How many tensors one forward saves for backward that are bf16 weights of a scaled fp8 Linear (by value)."""
    weights = []
    for m in transformer.modules():
        if isinstance(m, fp8.ScaledFp8Linear):
            weight = fp8.dequantise(m.weight, m.weight_scale, torch.bfloat16)
            weights += [weight, weight.T]  # F.linear saves it transposed
    saved = []

    def pack(t):
        if t.dtype == torch.bfloat16 and any(t.shape == w.shape and torch.equal(t, w) for w in weights):
            saved.append(t)
        return t

    config = transformer.config
    x = torch.randn(1, config.in_channels, 1, 8, 8).to(torch.bfloat16)
    text = torch.randn(1, 8, config.text_dim).to(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        transformer(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)
    return len({t.untyped_storage().data_ptr() for t in saved})


def test_without_checkpointing_every_block_keeps_its_dequantised_weights_for_backward(fp8_on_cpu):
    """Why the rule holds for scaled fp8 too: the bf16 weight each Linear is computed from is saved for the
    backward of its input, in every block; with checkpointing the forward saves none (they live one block at a time
    in the recompute)."""
    adapter = make_adapter("tiny-t2v", base_dtype="fp8_scaled", experts="high_noise")
    transformer = adapter.transformer_for("high_noise")
    transformer.disable_gradient_checkpointing()
    # 8 of a block's 10 Linears (cross-attention k/v read the text, which needs no gradient); 5 in the first block
    # (its self-attention q/k/v read the frozen patch embedding)
    assert _saved_dequantised_weights(transformer) == 5 + 8 * (len(transformer.blocks) - 1)
    transformer.enable_gradient_checkpointing()
    assert _saved_dequantised_weights(transformer) == 0


def _fp8_scaled_file(tiny_dir, tmp_path):
    """A ComfyUI ``fp8_scaled`` file of the tiny low-noise expert: block Linears in float8 with a scale per tensor
    (per output row for the FFN), its ``scale_input`` and marker tensors; the folder without ``transformer_2``."""
    import os

    from diffusers import WanTransformer3DModel

    path = tiny_dir("tiny-t2v")
    state = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer_2").state_dict()
    tensors, scales = {}, {}
    for key, value in to_comfyui_keys(state).items():
        if value.dim() == 2 and key.endswith(".weight") and ".blocks." in key:
            per_row = "ffn" in key
            scale = (value.abs().amax(dim=1, keepdim=True) if per_row else value.abs().max()) / 448.0
            tensors[key] = (value / scale).to(E4M3)
            tensors[key[: -len(".weight")] + ".scale_weight"] = scale.reshape(-1) if per_row else scale.reshape(())
            tensors[key[: -len(".weight")] + ".scale_input"] = torch.ones(())
            scales[key] = scale
        else:
            tensors[key] = value
    tensors["scaled_fp8"] = torch.zeros(0, dtype=E4M3)
    file = tmp_path / "low_fp8_scaled.safetensors"
    save_file(tensors, str(file))
    partial = tmp_path / "no_transformer_2"
    partial.mkdir()
    for entry in os.listdir(path):
        if entry != "transformer_2":
            os.symlink(path / entry, partial / entry)
    return partial, file, tensors


def test_a_comfyui_fp8_scaled_file_stays_float8_with_its_scales_and_matches_the_multiply_at_load(
        fp8_on_cpu, tiny_dir, tmp_path):
    folder, file, tensors = _fp8_scaled_file(tiny_dir, tmp_path)
    kept = make_adapter("tiny-t2v", path=str(folder), low_noise_file=str(file), experts="low_noise",
                        base_dtype="fp8_scaled")
    multiplied = make_adapter("tiny-t2v", path=str(folder), low_noise_file=str(file), experts="low_noise",
                              base_dtype="bf16")  # the file's weights multiplied out at load (single_file.py)
    block = kept.transformer_for("low_noise").blocks[1]
    for layer, key in ((block.attn1.to_q.base_layer, "blocks.1.self_attn.q"),
                       (block.ffn.net[0].proj.base_layer, "blocks.1.ffn.0")):
        assert isinstance(layer, fp8.ScaledFp8Linear)
        in_file = tensors[f"model.diffusion_model.{key}.weight"]
        assert torch.equal(layer.weight.view(torch.uint8), in_file.view(torch.uint8))  # the file's bytes
        scale = tensors[f"model.diffusion_model.{key}.scale_weight"]
        assert torch.equal(layer.weight_scale, scale.reshape(-1, 1).expand(layer.out_features, 1))
    batch = kept.encode_batch(raw_batch(frames=5, size=32))
    losses = [a.loss(batch, "low_noise", torch.Generator().manual_seed(3)) for a in (kept, multiplied)]
    # each weight is the same float32 product rounded once to bf16, at load or just in time
    assert torch.equal(losses[0], losses[1])


def test_a_bf16_single_file_is_quantised_as_it_is_read_to_the_same_weights_as_the_folder(fp8_on_cpu, tiny_dir,
                                                                                         tmp_path):
    from wan22_helpers import single_file_pair

    folder, from_file = single_file_pair(tiny_dir, tmp_path, torch.bfloat16, base_dtype="fp8_scaled")
    a, b = (dict(x.transformer_for("low_noise").named_buffers()) for x in (folder, from_file))
    scales = [n for n in a if n.endswith(".weight_scale")]
    assert len(scales) == 10 * len(folder.transformer_for("low_noise").blocks)
    assert all(torch.equal(a[n], b[n]) for n in scales)
    p, q = (dict(x.transformer_for("low_noise").named_parameters()) for x in (folder, from_file))
    weights = [n for n in p if n.endswith("base_layer.weight")]
    assert all(p[n].dtype == q[n].dtype == E4M3 and torch.equal(p[n].view(torch.uint8), q[n].view(torch.uint8))
               for n in weights)


def test_the_memory_planner_counts_the_scales_and_the_bf16_copies_of_scaled_fp8():
    from wantrain.models.wan22.memory import MemorySettings, estimate, weight_bytes

    rest8, blocks8 = weight_bytes("t2v-a14b", "fp8")
    rest_s, blocks_s = weight_bytes("t2v-a14b", "fp8_scaled")
    # per output row of a block's 10 Linears (8 x 5120 + 13824 + 5120): a float32 scale, and a bias in bf16
    # rather than float8
    assert rest_s == rest8 and blocks_s[0] - blocks8[0] == (8 * 5120 + 13824 + 5120) * (4 + 1)
    size = dict(width=832, height=480, frames=81, rank=32)
    plain, scaled = (estimate("t2v-a14b", MemorySettings(d, 20, True), **size) for d in ("fp8", "fp8_scaled"))
    assert scaled.parts["one recomputed block"] == plain.parts["one recomputed block"]  # the bf16 weight copies
    assert 0 < scaled.allocated - plain.allocated < 0.01 * plain.allocated


def test_block_swap_moves_the_scales_with_the_float8_weights_and_gives_the_same_gradients(fp8_on_cpu):
    plain = make_adapter("tiny-t2v", base_dtype="fp8_scaled", experts="high_noise")
    swapped = make_adapter("tiny-t2v", base_dtype="fp8_scaled", experts="high_noise", blocks_to_swap=1)
    last = swapped.transformer_for("high_noise").blocks[-1].attn1.to_q.base_layer
    assert last.weight.is_meta and last.weight_scale.is_meta  # unloaded: both are placeholders
    batch = plain.encode_batch(raw_batch())
    grads = []
    for adapter in (plain, swapped):
        adapter.loss(batch, "high_noise", torch.Generator().manual_seed(3)).backward()
        grads.append([p.grad for p in adapter.trainable_parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
