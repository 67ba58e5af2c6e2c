"""A tiny VACE run end to end (``tiny-vace-t2v`` on clips with control videos, a mask and a reference image,
docs/models.md "Control: VACE and first-last frame"): it trains both experts, writes each expert's LoRA and a
ComfyUI workflow around ``WanVaceToVideo``, samples through diffusers' ``WanVACEPipeline`` with a clip's control
files, and a run stopped after its first step and resumed gives the same LoRA files, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inprocess import wantrain
from safetensors.torch import load_file

from wantrain.data.demo import render, write_video

pytestmark = pytest.mark.slow  # whole runs of the tiny model

STEPS = 2  # switch_every = 1: step 1 trains the high-noise expert, step 2 the low-noise one


def clip(folder: Path, name: str, shape: str, frames: int = 9) -> None:
    write_video(folder / f"{name}.mp4", render(shape, (230, 40, 40), (0, 0, 0), "left", 32, 32, frames), 16.0)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vace_run")
    data = root / "data"
    data.mkdir()
    for name in ("a", "b"):
        clip(data, name, "circle")
        clip(data, f"{name}.control", "square")  # a stand-in for a pose or depth video, frame for frame
        clip(data, f"{name}.mask", "circle")
        (data / f"{name}.txt").write_text("a red circle moving left")
    (root / "run.toml").write_text(f"""
[run]
output_dir = "{root / 'runs'}"
name = "vace"
seed = 0
[model]
variant = "tiny-vace-t2v"
switch_every = 1
gradient_checkpointing = false
[lora]
rank = 4
[data]
path = "{data}"
resolutions = [32]
frames = [9]
[train]
max_steps = {STEPS}
log_every = 1
device = "cpu"
[checkpoint]
every = 1
[optimizer]
lr = 1e-3
[observers]
progress = false
[sample]
enabled = false
prompts = ["a red circle"]
every = {STEPS}
frames = 9
width = 32
height = 32
steps = 2
guidance_scale = 1.0
""")
    return root


def run(workspace: Path, out: str, *args: str) -> Path:
    done = wantrain("run", workspace / "run.toml", "--set", f"run.output_dir={workspace / out}", *args)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (workspace / out).iterdir()
    return run_dir


@pytest.fixture(scope="module")
def straight(workspace) -> Path:
    """The uninterrupted run, sampling at its last step."""
    return run(workspace, "straight", "--set", "sample.enabled=true")


def test_a_vace_run_trains_both_experts_and_writes_their_files_and_a_vace_workflow(straight):
    for expert in ("high_noise", "low_noise"):
        tensors = load_file(straight / f"vace_{expert}.safetensors")
        vace = {k: v for k, v in tensors.items() if ".vace_blocks." in k and k.endswith("lora_B.weight")}
        assert vace and all(v.abs().sum() > 0 for v in vace.values())  # each expert's VACE LoRA trained (B starts 0)
    graph = json.loads((straight / "vace.workflow.json").read_text())
    assert {"WanVaceToVideo", "TrimVideoLatent", "LoadVideo"} <= {n["class_type"] for n in graph.values()}


def test_the_sample_goes_through_the_vace_pipeline_with_a_clips_control_video_and_mask(straight):
    log = [json.loads(x) for x in (straight / "log.jsonl").read_text().splitlines()]
    (conditions,) = [e for e in log if e["event"] == "sample_conditions"]
    assert conditions["inputs"] == ["mask", "video"] and conditions["source"].endswith("a.mp4")
    assert (straight / "samples" / f"step_{STEPS:06d}_00.mp4").stat().st_size > 0


def test_a_vace_run_resumed_after_its_first_step_gives_the_same_loras_bit_for_bit(workspace, straight):
    first = run(workspace, "resumed", "--max-steps", "1")
    again = run(workspace, "resumed", "--resume", str(first), "--max-steps", str(STEPS))
    assert again == first
    for expert in ("high_noise", "low_noise"):
        name = f"vace_{expert}.safetensors"
        assert (first / name).read_bytes() == (straight / name).read_bytes(), name


SWAPPED_FP8 = ("--set", "model.gradient_checkpointing=true", "--set", 'model.base_dtype="fp8_scaled"')


@pytest.fixture
def stored(monkeypatch) -> dict[str, list]:
    """fp8 allowed on the CPU in this process; each block swap built records the class of every block it swaps,
    each scaled fp8 conversion of an expert (not the planner's on ``meta``) its number of ScaledFp8Linears."""
    from wantrain.models.wan22 import adapter, fp8

    monkeypatch.setattr(adapter, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    seen: dict[str, list] = {"swapped": [], "fp8": []}
    swap, convert = adapter.BlockSwap, fp8.to_scaled_fp8

    def block_swap(root, blocks, swapped, *args, **kwargs):
        seen["swapped"].append([type(blocks[k]).__name__ for k in swapped])
        return swap(root, blocks, swapped, *args, **kwargs)

    def to_scaled_fp8(model, *args, **kwargs):
        model = convert(model, *args, **kwargs)
        if next(model.parameters()).device.type != "meta":
            seen["fp8"].append(sum(isinstance(m, fp8.ScaledFp8Linear) for m in model.modules()))
        return model

    monkeypatch.setattr(adapter, "BlockSwap", block_swap)
    monkeypatch.setattr(fp8, "to_scaled_fp8", to_scaled_fp8)
    return seen


def test_vace_blocks_swapped_offloaded_and_in_scaled_fp8_train_as_resident_and_resume_bit_for_bit(workspace,
                                                                                                 stored):
    resident = run(workspace, "fp8", *SWAPPED_FP8)
    assert stored == {"swapped": [], "fp8": [43, 43]}  # per expert: 2 x 10 main + 2 x 11 VACE Linears + proj_in
    swapped = ("--set", "model.blocks_to_swap=4", "--set", "model.offload_activations=true", *SWAPPED_FP8)
    first = run(workspace, "fp8_swapped", *swapped, "--max-steps", "1")
    again = run(workspace, "fp8_swapped", *swapped, "--resume", str(first), "--max-steps", str(STEPS))
    assert again == first
    every_block = ["WanVACETransformerBlock"] * 2 + ["WanTransformerBlock"] * 2
    assert stored["swapped"] == [every_block] * 4  # two experts, in the run and in the resume
    for expert in ("high_noise", "low_noise"):
        name = f"vace_{expert}.safetensors"
        assert (first / name).read_bytes() == (resident / name).read_bytes(), name
