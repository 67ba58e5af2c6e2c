"""The ComfyUI workflow written beside each saved LoRA set (wantrain/observers/evaluation/workflow.py) is a valid
graph of ComfyUI's built-in nodes and carries the run's sample settings."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from diffusers import UniPCMultistepScheduler

from wantrain.app.config import load_config
from wantrain.models.wan22.variants import VARIANTS
from wantrain.observers.evaluation.config import StackedLora
from wantrain.observers.evaluation.workflow import ComfyWorkflow, workflow_path, workflow_settings

# ComfyUI's built-in nodes the workflow may use: class_type -> (required inputs, output types). An input's type is
# a ComfyUI type (a link of that type) or, for widgets, INT / FLOAT / STRING / BOOLEAN or a tuple of the combo's
# options (only the options wantrain writes are listed for the file-name combos, which list the user's folder).
# Taken from ComfyUI's source, master of 2025-08 (the Wan 2.2 release, v0.3.4x): nodes.py (CLIPTextEncode,
# VAEDecode, VAELoader, UNETLoader, CLIPLoader, LoraLoaderModelOnly, KSampler, KSamplerAdvanced, LoadImage),
# comfy_extras/nodes_model_advanced.py (ModelSamplingSD3), nodes_hunyuan.py (EmptyHunyuanLatentVideo),
# nodes_wan.py (WanImageToVideo at 4c946643; Wan22ImageToVideoLatent; WanFirstLastFrameToVideo, WanVaceToVideo and
# TrimVideoLatent, whose schemas are unchanged on master of 2025-12), nodes_images.py (SaveAnimatedWEBP),
# nodes_video.py (LoadVideo, GetVideoComponents).
# Optional inputs wantrain sets: CLIPLoader.device, WanImageToVideo.start_image, Wan22ImageToVideoLatent.start_image,
# WanFirstLastFrameToVideo.start_image / end_image, WanVaceToVideo.control_video.
FILE = "file name"
SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_sde", "ddim", "uni_pc", "uni_pc_bh2", "lcm")
SCHEDULERS = ("simple", "normal", "karras", "exponential", "sgm_uniform", "ddim_uniform", "beta", "linear_quadratic")
COMFY_NODES: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "UNETLoader": ({"unet_name": FILE, "weight_dtype": ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")},
                   ("MODEL",)),
    "CLIPLoader": ({"clip_name": FILE, "type": ("stable_diffusion", "stable_cascade", "sd3", "stable_audio",
                                                "mochi", "ltxv", "pixart", "cosmos", "lumina2", "wan", "hidream",
                                                "chroma", "ace", "omnigen2", "qwen_image")},
                   ("CLIP",)),
    "VAELoader": ({"vae_name": FILE}, ("VAE",)),
    "LoraLoaderModelOnly": ({"model": "MODEL", "lora_name": FILE, "strength_model": "FLOAT"}, ("MODEL",)),
    "ModelSamplingSD3": ({"model": "MODEL", "shift": "FLOAT"}, ("MODEL",)),
    "CLIPTextEncode": ({"text": "STRING", "clip": "CLIP"}, ("CONDITIONING",)),
    "EmptyHunyuanLatentVideo": ({"width": "INT", "height": "INT", "length": "INT", "batch_size": "INT"},
                                ("LATENT",)),
    "WanImageToVideo": ({"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE", "width": "INT",
                         "height": "INT", "length": "INT", "batch_size": "INT"},
                        ("CONDITIONING", "CONDITIONING", "LATENT")),
    "Wan22ImageToVideoLatent": ({"vae": "VAE", "width": "INT", "height": "INT", "length": "INT",
                                 "batch_size": "INT"}, ("LATENT",)),
    "LoadImage": ({"image": FILE}, ("IMAGE", "MASK")),
    "WanFirstLastFrameToVideo": ({"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE",
                                  "width": "INT", "height": "INT", "length": "INT", "batch_size": "INT"},
                                 ("CONDITIONING", "CONDITIONING", "LATENT")),
    "WanVaceToVideo": ({"positive": "CONDITIONING", "negative": "CONDITIONING", "vae": "VAE", "width": "INT",
                        "height": "INT", "length": "INT", "batch_size": "INT", "strength": "FLOAT"},
                       ("CONDITIONING", "CONDITIONING", "LATENT", "INT")),
    "TrimVideoLatent": ({"samples": "LATENT", "trim_amount": "INT"}, ("LATENT",)),
    "LoadVideo": ({"file": FILE}, ("VIDEO",)),
    "GetVideoComponents": ({"video": "VIDEO"}, ("IMAGE", "AUDIO", "FLOAT")),
    "KSampler": ({"model": "MODEL", "seed": "INT", "steps": "INT", "cfg": "FLOAT", "sampler_name": SAMPLERS,
                  "scheduler": SCHEDULERS, "positive": "CONDITIONING", "negative": "CONDITIONING",
                  "latent_image": "LATENT", "denoise": "FLOAT"}, ("LATENT",)),
    "KSamplerAdvanced": ({"model": "MODEL", "add_noise": ("enable", "disable"), "noise_seed": "INT", "steps": "INT",
                          "cfg": "FLOAT", "sampler_name": SAMPLERS, "scheduler": SCHEDULERS,
                          "positive": "CONDITIONING", "negative": "CONDITIONING", "latent_image": "LATENT",
                          "start_at_step": "INT", "end_at_step": "INT",
                          "return_with_leftover_noise": ("disable", "enable")}, ("LATENT",)),
    "VAEDecode": ({"samples": "LATENT", "vae": "VAE"}, ("IMAGE",)),
    "SaveAnimatedWEBP": ({"images": "IMAGE", "filename_prefix": "STRING", "fps": "FLOAT", "lossless": "BOOLEAN",
                          "quality": "INT", "method": ("default", "fastest", "slowest")}, ()),
}
OPTIONAL = {("CLIPLoader", "device"): ("default", "cpu"), ("WanImageToVideo", "start_image"): "IMAGE",
            ("Wan22ImageToVideoLatent", "start_image"): "IMAGE", ("WanFirstLastFrameToVideo", "start_image"): "IMAGE",
            ("WanFirstLastFrameToVideo", "end_image"): "IMAGE", ("WanVaceToVideo", "control_video"): "IMAGE"}
WIDGETS = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool, FILE: str}


def check_graph(graph: dict) -> None:
    """Every node a built-in class with its required inputs; every link to an existing node's output of the input's
    type; every widget of its type or among the combo's options; one output node."""
    for key, node in graph.items():
        required, _ = COMFY_NODES[node["class_type"]]
        inputs = node["inputs"]
        assert set(required) <= set(inputs), (key, node["class_type"], set(required) - set(inputs))
        for name, value in inputs.items():
            kind = required.get(name, OPTIONAL.get((node["class_type"], name)))
            assert kind is not None, f"node {key} ({node['class_type']}) has no input {name!r}"
            if isinstance(value, list):  # a link [source id, output index]
                source = graph[value[0]]
                outputs = COMFY_NODES[source["class_type"]][1]
                assert value[1] < len(outputs) and outputs[value[1]] == kind, (key, name, value, outputs)
            elif isinstance(kind, tuple):
                assert value in kind, (key, name, value)
            else:
                assert isinstance(value, WIDGETS[kind]) and not (kind == "INT" and isinstance(value, bool)), \
                    (key, name, value)
    assert [n["class_type"] for n in graph.values() if not COMFY_NODES[n["class_type"]][1]] == ["SaveAnimatedWEBP"]


def config(tmp_path: Path, variant: str, extra: str = "") -> object:
    path = tmp_path / "run.toml"
    path.write_text(f"""
[model]
variant = "{variant}"
{extra}
[data]
path = "{tmp_path}"
[sample]
enabled = true
steps = 8
guidance_scale = 3.0
guidance_scale_high_noise = {4.0 if variant != "tiny-ti2v" else 3.0}
negative_prompt = "blurry"
seed = 42
prompts = [{{ prompt = "a red fox", width = 64, height = 48, frames = 9, seed = 7 }}, "second"]
""")
    return load_config(path, overrides=[])


def by_class(graph: dict, class_type: str) -> list[dict]:
    return [n for n in graph.values() if n["class_type"] == class_type]


@pytest.mark.parametrize(("variant", "extra", "family_node"), [
    ("tiny-t2v", "", "EmptyHunyuanLatentVideo"), ("tiny-i2v", "", "WanImageToVideo"),
    ("tiny-ti2v", "", "Wan22ImageToVideoLatent"),
    ("tiny-i2v", 'condition = "first_last"', "WanFirstLastFrameToVideo"),
    ("tiny-vace-t2v", "", "WanVaceToVideo"),
])
def test_workflow_is_a_valid_graph_of_comfyuis_built_in_nodes_with_the_first_prompts_settings(variant, extra,
                                                                                          family_node, tmp_path):
    cfg = config(tmp_path, variant, extra)
    spec = VARIANTS[variant]
    shift = 5.0 if variant == "tiny-ti2v" else 3.0
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    experts = cfg.model.trained_experts
    observer = ComfyWorkflow(workflow_settings(cfg, spec, scheduler), experts)
    names = ([tmp_path / f"hero_step000200_{e}.safetensors" for e in experts] if experts != (None,)
             else [tmp_path / "hero_step000200.safetensors"])
    written = observer.write([str(p) for p in names])
    assert written == tmp_path / "hero_step000200.workflow.json"
    graph = json.loads(written.read_text())
    check_graph(graph)
    texts = sorted(n["inputs"]["text"] for n in by_class(graph, "CLIPTextEncode"))
    assert texts == ["a red fox", "blurry"]
    loras = {n["inputs"]["lora_name"]: n["inputs"]["strength_model"] for n in by_class(graph, "LoraLoaderModelOnly")}
    assert loras == {p.name: 1.0 for p in names}
    assert {n["inputs"]["shift"] for n in by_class(graph, "ModelSamplingSD3")} == {shift}
    assert len(by_class(graph, family_node)) == 1
    if family_node == "WanFirstLastFrameToVideo":  # the first and the last frame, each its own image
        flf = by_class(graph, family_node)[0]["inputs"]
        assert [graph[flf[k][0]]["inputs"]["image"] for k in ("start_image", "end_image")] == [
            "first_frame.png", "last_frame.png"]
    if family_node == "WanVaceToVideo":  # the control video in, the reference frames cut off after sampling
        (trim,) = by_class(graph, "TrimVideoLatent")
        assert graph[trim["inputs"]["trim_amount"][0]]["class_type"] == "WanVaceToVideo"
        assert by_class(graph, "LoadVideo")[0]["inputs"]["file"] == "control_video.mp4"
    latent = next(n for n in graph.values() if "length" in n["inputs"])
    assert (latent["inputs"]["width"], latent["inputs"]["height"], latent["inputs"]["length"]) == (64, 48, 9)
    if spec.boundary_ratio is None:
        (sampler,) = by_class(graph, "KSampler")
        assert (sampler["inputs"]["seed"], sampler["inputs"]["steps"], sampler["inputs"]["cfg"]) == (7, 8, 3.0)
        return
    high, low = by_class(graph, "KSamplerAdvanced")
    scheduler.set_timesteps(8)
    k = sum(t >= spec.boundary_ratio * 1000 for t in scheduler.timesteps.tolist())
    assert 0 < k < 8
    assert (high["inputs"]["start_at_step"], high["inputs"]["end_at_step"], low["inputs"]["start_at_step"]) == (0, k, k)
    assert high["inputs"]["return_with_leftover_noise"] == "enable" and low["inputs"]["add_noise"] == "disable"
    assert (high["inputs"]["cfg"], low["inputs"]["cfg"]) == (4.0, 3.0)
    assert high["inputs"]["noise_seed"] == low["inputs"]["noise_seed"] == 7
    # each expert's LoRA sits on that expert's model
    for sampler, expert in ((high, "high_noise"), (low, "low_noise")):
        shifted = graph[sampler["inputs"]["model"][0]]
        lora = graph[shifted["inputs"]["model"][0]]
        assert lora["inputs"]["lora_name"] == f"hero_step000200_{expert}.safetensors"
        assert expert in graph[lora["inputs"]["model"][0]]["inputs"]["unet_name"]


def test_the_configs_single_files_are_named_and_a_diffusers_folder_gets_comfyuis_usual_names(tmp_path):
    cfg = config(tmp_path, "tiny-t2v", extra=f'high_noise_file = "{tmp_path}/my_high.safetensors"\n'
                                             f'vae_file = "{tmp_path}/my_vae.safetensors"')
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    settings = workflow_settings(cfg, VARIANTS["tiny-t2v"], scheduler)
    assert settings.files["high_noise"] == "my_high.safetensors" and settings.files["vae"] == "my_vae.safetensors"
    assert settings.files["low_noise"] == "wan2.2_t2v_low_noise_14B_fp16.safetensors"
    assert "usual" in settings.file_notes["low_noise"] and settings.file_notes["vae"] == "model.vae_file"


def test_the_first_prompts_stacked_loras_come_under_the_trained_one_on_their_expert(tmp_path):
    fast = tmp_path / "lightx2v_high.safetensors"
    cfg = config(tmp_path, "tiny-t2v", extra="")
    cfg = attrs.evolve(cfg, sample=attrs.evolve(cfg.sample, loras=[StackedLora(path=fast, strength=0.8,
                                                                                  expert="high_noise")]))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    observer = ComfyWorkflow(workflow_settings(cfg, VARIANTS["tiny-t2v"], scheduler), ("high_noise", "low_noise"))
    written = observer.write([str(tmp_path / "h_high_noise.safetensors"), str(tmp_path / "h_low_noise.safetensors")])
    graph = json.loads(written.read_text())
    check_graph(graph)
    chain = {}
    for n in by_class(graph, "LoraLoaderModelOnly"):
        chain[n["inputs"]["lora_name"]] = (graph[n["inputs"]["model"][0]]["class_type"], n["inputs"]["strength_model"])
    assert chain == {"lightx2v_high.safetensors": ("UNETLoader", 0.8),
                     "h_high_noise.safetensors": ("LoraLoaderModelOnly", 1.0),
                     "h_low_noise.safetensors": ("UNETLoader", 1.0)}


def test_workflow_path_drops_the_expert_suffix():
    assert workflow_path("/r/x_step000010_low_noise.safetensors", "low_noise") == Path("/r/x_step000010.workflow.json")
    assert workflow_path("/r/x.safetensors", None) == Path("/r/x.workflow.json")
