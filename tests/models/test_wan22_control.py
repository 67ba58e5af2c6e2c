"""Control LoRAs on the tiny twins (``models/wan22/control.py``, docs/models.md "Control: VACE and first-last
frame"): the VACE control context and the first-last-frame condition equal what diffusers' own pipelines build;
the VACE LoRA adapts the main and the VACE blocks (or not the VACE blocks, ``model.vace_blocks = "frozen"``), and
its file loads in ComfyUI's loader with 0 unloaded keys, applied by ComfyUI's formula equals the trained model, and
``inspect-lora`` agrees on every key; first-last-frame trains and samples; the configs they do not fit are refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan22_helpers import make_adapter, raw_batch, to_comfyui_keys, train_steps

from wantrain.cli.inspect_lora import inspect
from wantrain.core.errors import ConfigError, UserError
from wantrain.models.wan22 import ModelConfig, architecture, control
from wantrain.models.wan22.adapter_types import VACE_TO_WAN
from wantrain.models.wan22.export import lora_layers
from wantrain.models.wan22.single_file import wan_key_map
from wantrain.models.wan22.variants import VARIANTS

VACE = VARIANTS["tiny-vace-t2v"]
SUFFIXES = ("lora_A.weight", "lora_B.weight", "alpha")  # the LoRA parts comfy/lora.py reads for a module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny VACE adapter (LoRA on every Linear of both block stacks) trained 2 steps per expert on a batch with
    a control video, a mask and a reference image, and its exported files (fp32)."""
    adapter = make_adapter("tiny-vace-t2v", switch_every=1, alpha=3.0, gradient_checkpointing=False,
                           lora={"save_dtype": "fp32"})
    g = torch.Generator().manual_seed(5)
    conditions = {"control": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1,
                  "mask": (torch.rand(1, 1, 9, 32, 32, generator=g) > 0.5).float(),
                  "reference": torch.rand(1, 3, 1, 32, 32, generator=g) * 2 - 1}
    batch = adapter.encode_batch({**raw_batch(), "conditions": conditions})
    train_steps(adapter, batch, steps=4, lr=2e-2)
    files = adapter.saver(tmp_path_factory.mktemp("vace"), "vace").save(step=4, final=True)
    return adapter, batch, dict(zip(adapter.experts, files, strict=True))


def test_the_vace_context_is_the_one_diffusers_vace_pipeline_builds():
    vae = architecture.tiny_vae(VACE, 0)
    pipe = architecture.vace_pipeline()(tokenizer=None, text_encoder=None, vae=vae, scheduler=None,
                                        transformer=architecture.tiny_transformer(VACE, 0, "high_noise"))
    g = torch.Generator().manual_seed(1)
    pixels, video = (torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1 for _ in range(2))
    mask = (torch.rand(1, 1, 9, 32, 32, generator=g) > 0.5).float()
    reference = torch.rand(1, 3, 1, 32, 32, generator=g) * 2 - 1
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        ours = control.vace_context(lambda x: (vae.encode(x).latent_dist.mode() - mean) / std, pixels,
                                    {"control": video, "mask": mask, "reference": reference}, stride=8)
    with torch.no_grad():
        latents = pipe.prepare_video_latents(video, mask.expand(-1, 3, -1, -1, -1), [[reference[0, :, 0]]],
                                             device=torch.device("cpu"))
        masks = pipe.prepare_masks(mask.expand(-1, 3, -1, -1, -1), [[reference[0, :, 0]]])
    theirs = torch.cat([latents, masks], dim=1)
    assert ours["vace_context"].shape == theirs.shape == (1, 96, 4, 4, 4)
    torch.testing.assert_close(ours["vace_context"], theirs, rtol=1e-5, atol=1e-5)
    assert ours["latents"].shape == (1, 16, 4, 4, 4)  # the reference's latent frame in front of the clip's 3


def test_the_first_last_frame_condition_is_the_one_diffusers_i2v_pipeline_builds_with_last_image():
    spec = VARIANTS["tiny-i2v"]
    adapter = make_adapter("tiny-i2v", condition="first_last")
    pixels = raw_batch()["pixels"]
    ours = adapter.encode_media(pixels)["cond_latents"]
    _, i2v = architecture.wan_pipelines()
    pipe = i2v(tokenizer=None, text_encoder=None, vae=architecture.tiny_vae(spec, 0), scheduler=None,
               image_encoder=None, image_processor=None,
               transformer=architecture.tiny_transformer(spec, 0, "high_noise"))
    with torch.no_grad():
        _, theirs = pipe.prepare_latents(pixels[:, :, 0], 1, 16, 32, 32, 9, torch.float32, torch.device("cpu"),
                                         torch.Generator().manual_seed(0), last_image=pixels[:, :, -1])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours[0, :4, :, 0, 0].tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]  # last pixel frame of the last


def test_the_vace_lora_adapts_both_block_stacks_unless_the_vace_blocks_are_frozen():
    adapted = [n for n, _ in lora_layers(make_adapter("tiny-vace-t2v").transformer_for("high_noise"))]
    assert len(adapted) == 2 * 10 + (12 + 11)  # VACE block 0 also has proj_in; both have proj_out
    assert "vace_blocks.0.proj_in" in adapted and "vace_blocks.1.proj_out" in adapted
    frozen = make_adapter("tiny-vace-t2v", vace_blocks="frozen").transformer_for("low_noise")
    assert [n for n, _ in lora_layers(frozen)] == [n for n in adapted if n.startswith("blocks.")]


def comfyui_state(state: dict) -> dict:
    """A VACE transformer's state dict under ComfyUI's single-file names: the tests' mapping
    (``wan22_helpers.to_comfyui_keys``) with VACE's ``proj_in`` / ``proj_out`` as ``before_proj`` / ``after_proj``."""
    def original(key: str) -> str:
        return re.sub(r"^(vace_blocks\.\d+)\.proj_(in|out)\.",
                      lambda m: f"{m[1]}.{'before' if m[2] == 'in' else 'after'}_proj.", key)

    return to_comfyui_keys({original(k): v for k, v in state.items()})


def comfyui_state_names(transformer) -> set[str]:
    """The tensor names of the ComfyUI model of ``transformer`` (original Wan names, ``diffusion_model.`` prefix,
    :func:`comfyui_state`), checked to give back every tensor through diffusers' own single-file conversion
    (``single_file.wan_key_map``)."""
    comfy = comfyui_state(transformer.state_dict())
    assert set(wan_key_map(comfy)) == set(transformer.state_dict())  # every tensor, by diffusers' conversion
    return {k.removeprefix("model.") for k in comfy}


def comfyui_unloaded(file_keys, model_names: set[str]) -> list[str]:
    """The keys of a LoRA file ComfyUI's loader leaves unloaded (comfy/lora.py: a module ``diffusion_model.X`` is
    known when the model has ``diffusion_model.X.weight``; its ``lora_A/B.weight`` and ``alpha`` are read)."""
    known = {n.removesuffix(".weight") for n in model_names if n.endswith(".weight")}
    return [k for k in file_keys if not any(k == f"{m}.{s}" for s in SUFFIXES for m in [k.rsplit(".", 2 if
            k.endswith(".weight") else 1)[0]] if m in known)]


def test_the_vace_lora_loads_in_comfyuis_loader_with_0_unloaded_keys_and_inspect_lora_agrees(trained):
    adapter, _, files = trained
    for expert, file in files.items():
        keys = sorted(load_file(file))
        assert any(".vace_blocks.0.before_proj." in k for k in keys) and any(".vace_blocks.1.after_proj." in k
                                                                              for k in keys)
        names = comfyui_state_names(architecture.tiny_transformer(VACE, 0, expert))
        assert comfyui_unloaded(keys, names) == []
        lines = inspect(file)
        assert f"modules: {len(keys) // 3} ({len(keys)} tensors)" in lines and "VACE blocks: 23 of the modules" in lines
    tensors = load_file(files["high_noise"])
    tensors["diffusion_model.vace_blocks.2.after_proj.alpha"] = torch.tensor(4.0)  # the tiny twin has 2
    bad = Path(files["high_noise"]).with_name("bad.safetensors")
    save_file(tensors, str(bad), metadata={"variant": "tiny-vace-t2v"})
    with pytest.raises(UserError, match="names VACE block 2, but tiny-vace-t2v has VACE blocks 0..1"):
        inspect(bad)


def test_the_exported_vace_file_applied_as_comfyui_applies_it_gives_the_trained_model(trained):
    adapter, batch, files = trained
    expert = "low_noise"
    base = architecture.tiny_transformer(VACE, 0, expert).eval()
    tensors = load_file(files[expert])
    layers = dict(base.named_modules())
    wan_to_diffusers = {w: d for d, w in VACE_TO_WAN.items()}
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            module = key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight")
            stack, block, leaf = module.split(".", 2)
            weight = layers[f"{stack}.{block}.{wan_to_diffusers[leaf]}"].weight
            down, up = tensors[key], tensors[key.replace("lora_A", "lora_B")]
            weight += float(tensors[f"diffusion_model.{module}.alpha"]) / down.shape[0] * (up @ down)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, 4, 4, generator=torch.Generator().manual_seed(2)),
                  timestep=torch.tensor([300.0]), encoder_hidden_states=batch["text_embeds"],
                  control_hidden_states=batch["vace_context"], return_dict=False)
    with adapter.evaluating():
        trained_out = adapter.transformer_for(expert)(**inputs)[0]
        torch.testing.assert_close(base(**inputs)[0], trained_out, rtol=0, atol=1e-5)


def test_first_last_frame_trains_and_samples_with_the_last_frame():
    adapter = make_adapter("tiny-i2v", condition="first_last", switch_every=1, gradient_checkpointing=False)
    batch = adapter.encode_batch(raw_batch())
    before = [p.detach().clone() for p in adapter.trainable_parameters("high_noise")]
    train_steps(adapter, batch, steps=2, lr=1e-2)
    assert any(not torch.equal(a, b) for a, b in zip(before, adapter.trainable_parameters("high_noise"), strict=True))
    from PIL import Image

    frames = ((raw_batch()["pixels"][0].permute(1, 2, 3, 0) + 1) * 127.5).to(torch.uint8).numpy()
    pipe = adapter.sampling_pipeline(architecture.tiny_vae(VARIANTS["tiny-i2v"], 0), image_to_video=True)
    with adapter.evaluating():
        out = pipe(image=Image.fromarray(frames[0]), last_image=Image.fromarray(frames[-1]), height=32, width=32,
                   num_frames=9, num_inference_steps=2, guidance_scale=1.0, output_type="np",
                   prompt_embeds=batch["text_embeds"], generator=torch.Generator().manual_seed(0)).frames
    assert out.shape == (1, 9, 32, 32, 3)


@pytest.mark.parametrize(("keys", "message"), [
    (dict(variant="tiny-t2v", condition="first_last"), "model.condition = 'first_last' conditions I2V-A14B"),
    (dict(variant="tiny-i2v", vace_blocks="frozen"), "model.vace_blocks = 'frozen' applies to the VACE variants"),
])
def test_control_settings_on_a_variant_without_them_are_refused_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**keys)
    assert control.problems(ModelConfig(variant=keys["variant"])) == []


def test_the_lean_recompute_of_the_vace_blocks_gives_the_whole_block_recomputes_gradients(trained, monkeypatch):
    from wantrain.models.wan22 import recompute
    from wantrain.models.wan22.recompute import LeanWanVACETransformerBlock, use_recompute

    monkeypatch.setattr(recompute, "FFN_CHUNK_TOKENS", 7)  # several FFN chunks, the last one short
    _, batch, _ = trained
    adapter = make_adapter("tiny-vace-t2v", experts="high_noise", blocks_to_swap=1, offload_activations=True,
                           pin_host_copies=False)

    def gradients() -> list[torch.Tensor]:
        adapter.loss(batch, "high_noise", torch.Generator().manual_seed(1)).backward()
        params = adapter.trainable_parameters("high_noise")
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return grads

    whole = gradients()
    transformer = adapter.transformer_for("high_noise")
    use_recompute(transformer, "lean")
    assert all(type(b) is LeanWanVACETransformerBlock for b in transformer.vace_blocks)
    lean = gradients()
    assert any(g.abs().sum() > 0 for g in lean)
    # the same ops on the same values; the VACE FFN's LoRA B gradients, summed over the token chunks, differ in the
    # last bits (measured: at most 4.7e-10, 4 of 86 tensors; unchunked every tensor is bitwise equal)
    for a, b in zip(lean, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_a_vace_expert_loads_from_a_diffusers_folder_and_from_a_comfyui_single_file_alike(tmp_path):
    from diffusers import WanVACETransformer3DModel

    folder = tmp_path / "vace"
    architecture.write_tiny_diffusers_dir(VACE, 0, folder)
    state = WanVACETransformer3DModel.from_pretrained(str(folder), subfolder="transformer_2").state_dict()
    single = tmp_path / "wan2.2_fun_vace_low_noise.safetensors"
    save_file(comfyui_state(state), str(single))
    loaded = [make_adapter("tiny-vace-t2v", experts="low_noise", **source).transformer_for("low_noise").state_dict()
              for source in (dict(path=str(folder)), dict(path=str(folder), low_noise_file=str(single)))]
    base = {k.replace(".base_layer.", "."): k for k in loaded[0] if ".wantrain." not in k}  # peft's wrapped names
    assert any(k.startswith("vace_blocks.1.proj_out") for k in base) and set(base) == set(state)
    assert all(torch.equal(loaded[0][ours], state[k]) and torch.equal(loaded[1][ours], state[k])
               for k, ours in base.items())


def test_a_run_starts_from_an_exported_vace_file_with_its_vace_blocks(trained):
    adapter, _, files = trained
    again = make_adapter("tiny-vace-t2v", experts="low_noise", lora={"init_from_low_noise": files["low_noise"]})
    want = dict(lora_layers(adapter.transformer_for("low_noise")))
    have = dict(lora_layers(again.transformer_for("low_noise")))
    assert set(have) == set(want) and "vace_blocks.0.proj_in" in have
    for name, layer in have.items():
        torch.testing.assert_close(layer.lora_B["wantrain"].weight, want[name].lora_B["wantrain"].weight)
    assert again.lora_alpha("low_noise") == 3.0


@pytest.mark.slow  # compiles (aot_eager: dynamo and AOTAutograd, no code generation)
def test_compiled_vace_blocks_train_as_eager(trained, monkeypatch):
    import torch._dynamo

    from wantrain.models.wan22 import compile as wan_compile
    from wantrain.models.wan22.compile import compile_counts, is_compiled

    monkeypatch.setattr(wan_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    _, batch, _ = trained
    losses = []
    for setting in ("off", "default"):
        adapter = make_adapter("tiny-vace-t2v", experts="high_noise", compile=setting)
        optimizer = torch.optim.AdamW(adapter.param_groups(), lr=1e-2)
        adapter.activate("high_noise", optimizer)
        before, got = compile_counts(), []
        for seed in (1, 2):
            loss = adapter.loss(batch, "high_noise", torch.Generator().manual_seed(seed))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            got.append(loss.item())
        losses.append(got)
    transformer = adapter.transformer_for("high_noise")
    assert all(is_compiled(b) for b in [*transformer.blocks, *transformer.vace_blocks])
    assert compile_counts()["graph_breaks"] == before["graph_breaks"]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch._dynamo.reset()
