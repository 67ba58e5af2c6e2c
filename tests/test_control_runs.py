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
