"""Block swap and scaled fp8 take a VACE transformer's VACE blocks like its main blocks (``swap.run_order``,
``fp8.targets``; docs/models.md "Control: VACE and first-last frame"), and the memory planner counts them as a run
stores them: block swap counts the blocks in the order the forward pass runs them (VACE blocks first), the
recompute goes back through them in reverse, a swapped VACE block holds placeholders until it runs (whole runs:
tests/test_control_runs.py); a local copy of the official release's layout loads like the diffusers folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from test_wan22_fp8 import fp8_on_cpu  # noqa: F401  (the fixture: fp8 storage allowed on the CPU)
from wan22_helpers import make_adapter, raw_batch, train_steps

from wantrain.models.wan22 import architecture, fp8
from wantrain.models.wan22.adapter_types import candidate_modules
from wantrain.models.wan22.export import ADAPTER_NAME, wan_state_dict
from wantrain.models.wan22.memory import weight_bytes
from wantrain.models.wan22.swap import BlockSwap, run_order, run_order_names, swapped_blocks
from wantrain.models.wan22.variants import VARIANTS

VACE = VARIANTS["tiny-vace-t2v"]


def control_batch(adapter) -> dict:
    g = torch.Generator().manual_seed(5)
    conditions = {"control": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1,
                  "mask": (torch.rand(1, 1, 9, 32, 32, generator=g) > 0.5).float()}
    return adapter.encode_batch({**raw_batch(), "conditions": conditions})


def checkpointed_vace_model():
    """The tiny VACE twin, checkpointed, with a LoRA of random B on every block Linear (every LoRA gets a
    gradient)."""
    model = architecture.tiny_transformer(VACE, 0, "high_noise")
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    torch.manual_seed(0)
    model.add_adapter(PeftLoraConfig(r=4, lora_alpha=4, target_modules=candidate_modules(2, 2)),
                      adapter_name=ADAPTER_NAME)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f".{ADAPTER_NAME}." in name:
                param.requires_grad_(True)
                if "lora_B" in name:
                    param.normal_()
    return model.train()


def vace_step(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 8, 8, generator=g)
    context = torch.randn(1, VACE.vace_in_channels, 3, 8, 8, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    out = model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                control_hidden_states=context, return_dict=False)[0]
    (out**2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_block_swap_counts_the_vace_blocks_first_and_the_recompute_goes_back_through_them_in_reverse():
    reference = vace_step(checkpointed_vace_model())
    model = checkpointed_vace_model()
    assert run_order_names(model) == ["vace_blocks.0", "vace_blocks.1", "blocks.0", "blocks.1"]
    blocks, swapped = swapped_blocks(model, 4)
    assert blocks[0] is model.vace_blocks[0] and list(swapped) == [0, 1, 2, 3]
    copies: list[int] = []
    swap = BlockSwap(model, blocks, swapped, torch.device("cpu"), ring=2, on_copy=copies.append)
    assert {p.device.type for p in model.vace_blocks[1].parameters() if not p.requires_grad} == {"meta"}
    grads = vace_step(model)
    assert grads.keys() == reference.keys() and any(k.startswith("vace_blocks.") for k in grads)
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    # Forward: the VACE blocks, then the main blocks, each copied ahead; the recompute runs them backwards and
    # finds the last two main blocks resident, then loads VACE block 1 and 0 again.
    assert copies == [0, 1, 2, 3, 1, 0]
    assert swap.loaded == (1, 0)


def test_with_every_block_swapped_the_expert_not_training_keeps_no_block_vace_blocks_included():
    """(That the swapped, offloaded run trains the resident run's LoRAs, bit for bit, is tests/test_control_runs.py's
    whole-run check.)"""
    adapter = make_adapter("tiny-vace-t2v", switch_every=1, gradient_checkpointing=True,
                           blocks_to_swap=VACE.all_blocks, offload_activations=True)
    assert adapter.swap_for("high_noise").swapped == (0, 1, 2, 3)
    train_steps(adapter, control_batch(adapter), 2, lr=2e-2)
    assert adapter.active == "low_noise"  # step 2's
    inactive = adapter.swap_for("high_noise")
    assert inactive.loaded == () and inactive.live_blocks() == []
    assert adapter.transformer_for("high_noise").vace_blocks[0].proj_in.base_layer.weight.is_meta
    trained = wan_state_dict(adapter.transformer_for("high_noise"), torch.float32)
    assert any(v.abs().sum() > 0 for k, v in trained.items() if ".vace_blocks." in k and "lora_B" in k)


def test_swapping_more_blocks_than_main_and_vace_blocks_together_is_refused_naming_both():
    from wantrain.core.errors import ConfigError
    from wantrain.models.wan22 import ModelConfig

    ModelConfig(variant="tiny-vace-t2v", blocks_to_swap=4, gradient_checkpointing=True)  # 2 main + 2 VACE
    with pytest.raises(ConfigError, match=r"exceeds the 4 blocks \(2 main \+ 2 VACE\) of tiny-vace-t2v; use 0..4"):
        ModelConfig(variant="tiny-vace-t2v", blocks_to_swap=5, gradient_checkpointing=True)


def test_scaled_fp8_stores_the_vace_blocks_linears_and_the_planner_counts_the_bytes_a_run_holds(fp8_on_cpu):  # noqa: F811
    adapter = make_adapter("tiny-vace-t2v", base_dtype="fp8_scaled", gradient_checkpointing=True,
                           experts="high_noise", blocks_to_swap=1)
    transformer = adapter.transformer_for("high_noise")
    stored = [m.base_layer for b in transformer.vace_blocks for m in b.modules() if hasattr(m, "base_layer")]
    assert len(stored) == 2 * 10 + 3 and all(isinstance(m, fp8.ScaledFp8Linear) for m in stored)
    assert {m.weight.dtype for m in stored} == {fp8.FP8}
    # the planner's blocks, in run order, hold the bytes of the run's blocks (fp8 weights, float32 scales, bf16
    # biases and norms, float32 modulation); the swapped one (the last main block) loaded to be counted
    _, planned = weight_bytes("tiny-vace-t2v", "fp8_scaled")
    adapter.swap_for("high_noise").load(3)
    for k, block in enumerate(run_order(transformer)):
        frozen = [t for t in [*block.parameters(), *block.buffers()] if not t.requires_grad]
        assert planned[k] == sum(t.numel() * t.element_size() for t in frozen), k
    assert planned[0] > planned[1] > planned[2]  # VACE block 0 has proj_in and proj_out, VACE block 1 proj_out


# The layout of the official release, alibaba-pai/Wan2.2-VACE-Fun-A14B (= ModelScope PAI/Wan2.2-VACE-Fun-A14B), read
# 2026-12-04 from public sources: VideoX-Fun's config/wan2.2/wan_civitai_t2v.yaml (transformer_{high,low}_noise_model
# _subpath ./high_noise_model, ./low_noise_model; vae_subpath Wan2.1_VAE.pth; text_encoder_subpath
# models_t5_umt5-xxl-enc-bf16.pth; tokenizer_subpath google/umt5-xxl), DiffSynth-Studio's
# examples/wanvideo/model_inference/Wan2.2-VACE-Fun-A14B.py (high_noise_model/diffusion_pytorch_model*.safetensors,
# low_noise_model/..., models_t5_umt5-xxl-enc-bf16.pth, Wan2.1_VAE.pth). Each expert folder holds the whole expert
# (main and VACE blocks) in the original Wan names: DiffSynth-Studio finds its classes by a hash of the keys and
# shapes, and its only 14B VACE entry is Wan2.1-VACE-14B's (vace_layers 0, 5, ..., 35, vace_in_dim 96). The folder's
# config.json is VideoX-Fun's (VaceWanTransformer3DModel's argument names; wantrain reads the tensors, not it).
RELEASE_EXPERTS = {"high_noise": "high_noise_model", "low_noise": "low_noise_model"}
VIDEOX_FUN_CONFIG = {"_class_name": "VaceWanTransformer3DModel", "dim": 24, "in_dim": 16, "out_dim": 16,
                     "num_layers": 2, "num_heads": 2, "vace_layers": [0, 1], "vace_in_dim": 96}  # tiny values


def test_a_local_copy_of_the_official_vace_fun_release_loads_like_the_diffusers_folder(tiny_dir, tmp_path):
    from diffusers import WanVACETransformer3DModel
    from test_wan22_control import comfyui_state
    from test_wan22_model_files import encoder_parts, t5_to_wan, vae_to_original, write_shards

    path, vae, text = encoder_parts(tiny_dir, "tiny-vace-t2v")
    release = tmp_path / "Wan2.2-VACE-Fun-A14B"
    for expert, folder in RELEASE_EXPERTS.items():
        state = WanVACETransformer3DModel.from_pretrained(
            str(path), subfolder="transformer" if expert == "high_noise" else "transformer_2").state_dict()
        write_shards(comfyui_state(state), release / folder)
        (release / folder / "config.json").write_text(json.dumps(VIDEOX_FUN_CONFIG))
    torch.save(vae_to_original(vae.state_dict()), release / "Wan2.1_VAE.pth")
    torch.save(t5_to_wan(text.state_dict()), release / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(path / "tokenizer", release / "google" / "umt5-xxl")
    files = make_adapter("tiny-vace-t2v", switch_every=1, high_noise_file=str(release / "high_noise_model"),
                         low_noise_file=str(release / "low_noise_model"), vae_file=str(release / "Wan2.1_VAE.pth"),
                         text_encoder_file=str(release / "models_t5_umt5-xxl-enc-bf16.pth"),
                         tokenizer_path=str(release / "google" / "umt5-xxl"))
    folder = make_adapter("tiny-vace-t2v", switch_every=1, path=str(path))
    batches = [control_batch(adapter) for adapter in (files, folder)]
    for expert in RELEASE_EXPERTS:
        losses = [adapter.loss(batch, expert, torch.Generator().manual_seed(2))
                  for adapter, batch in zip((files, folder), batches, strict=True)]
        assert torch.equal(*losses), expert
