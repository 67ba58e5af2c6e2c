"""Sample videos written during training equal what diffusers' own pipeline makes from the saved LoRA files."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from wantrain.app.assemble import prepare
from wantrain.app.config import load_config
from wantrain.models.wan22.architecture import write_tiny_diffusers_dir
from wantrain.models.wan22.variants import VARIANTS
from wantrain.observers.evaluation import samples as samples_module

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo_data"
PROMPT = "a magenta square moving up on a black background"
NEGATIVE = "a blue circle"
# Differences in uint8 levels allowed between the training-time sample and diffusers' own run: both compute in
# fp32 with the same weights (LoRA saved in fp32), so only the order of floating-point operations may differ.
TOLERANCE_LEVELS = 1


def write_config(tmp: Path, variant: str, model_dir: Path, *, image: bool, extra: str = "") -> Path:
    data = tmp / "data"
    data.mkdir()
    for name in ("clip_000", "clip_001", "image_000"):
        for src in DEMO.glob(f"{name}.*"):
            shutil.copy(src, data / src.name)
    images = f'images = ["{DEMO / "image_001.png"}"]' if image else ""
    config = tmp / "run.toml"
    config.write_text(f"""
[run]
output_dir = "runs"
name = "s"
[model]
variant = "{variant}"
path = "{model_dir}"
switch_every = 1
gradient_checkpointing = false
[lora]
rank = 4
alpha = 7
save_dtype = "fp32"
[data]
path = "data"
resolutions = [32]
frames = [5]
[train]
max_steps = 4
log_every = 1
device = "cpu"
[optimizer]
lr = 5e-2
[lr_scheduler]
type = "constant"
[observers]
progress = false
[sample]
enabled = true
prompts = ["{PROMPT}"]
{images}
every = 4
frames = 5
width = 32
height = 32
steps = 3
guidance_scale = 2.0
negative_prompt = "{NEGATIVE}"
seed = 5
{extra}
""", encoding="utf-8")
    return config


def record_videos(monkeypatch) -> dict[str, np.ndarray]:
    written: dict[str, np.ndarray] = {}
    original = samples_module.write_video

    def recording(path, frames, fps):
        written[Path(path).name] = frames.copy()
        original(path, frames, fps)

    monkeypatch.setattr(samples_module, "write_video", recording)
    return written


CASES = {"tiny-t2v": ("WanPipeline", False), "tiny-i2v": ("WanImageToVideoPipeline", True),
         "tiny-ti2v": ("WanImageToVideoPipeline", True)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CASES))
def test_training_sample_equals_diffusers_pipeline_with_the_saved_lora(variant, tmp_path, monkeypatch):
    import av
    import diffusers
    from PIL import Image

    pipeline_name, image = CASES[variant]
    model_dir = tmp_path / "model"
    write_tiny_diffusers_dir(VARIANTS[variant], 7, model_dir)
    written = record_videos(monkeypatch)
    outcome = prepare(load_config(write_config(tmp_path, variant, model_dir, image=image))).execute()
    assert outcome.status == "completed"
    assert sorted(written) == ["step_000000_00.mp4", "step_000004_00.mp4"]
    ours = written["step_000004_00.mp4"]
    assert ours.shape == (5, 32, 32, 3)
    effect = np.abs(ours.astype(int) - written["step_000000_00.mp4"]).max()
    assert effect > 4 * TOLERANCE_LEVELS, f"the LoRA changed the video by {effect} levels only: the test is vacuous"

    pipe = getattr(diffusers, pipeline_name).from_pretrained(str(model_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for path in outcome.saved:
        if "_step" not in Path(path).name:
            pipe.load_lora_weights(path, load_into_transformer_2="low_noise" in Path(path).name)
    kwargs = {}
    if image:
        with Image.open(DEMO / "image_001.png") as im:
            kwargs["image"] = im.convert("RGB")
    reference = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=32, num_frames=5,
                     num_inference_steps=3, guidance_scale=2.0, generator=torch.Generator().manual_seed(5),
                     max_sequence_length=VARIANTS[variant].text_len, output_type="np", **kwargs).frames[0]
    diff = np.abs(ours.astype(int) - samples_module.to_uint8(reference).astype(int)).max()
    print(f"{variant}: max difference {diff} uint8 levels (LoRA effect {effect})")
    assert diff <= TOLERANCE_LEVELS

    with av.open(str(outcome.run_dir / "samples" / "step_000004_00.mp4")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


def test_sampling_leaves_the_global_rng_and_train_mode_alone(tmp_path, monkeypatch):
    from tests.models.wan22_helpers import make_adapter
    from wantrain.observers.evaluation.samples import SampleVideos

    written = record_videos(monkeypatch)
    adapter = make_adapter("tiny-t2v", lora={"dropout": 0.2}, gradient_checkpointing=False)
    text = adapter.encode_text(["a red ball"])["text_embeds"]
    observer = SampleVideos(out_dir=tmp_path, prompt_embeds=[text], negative_embeds=text * 0, images=[],
                            width=32, height=32, frames=5, steps=2, guidance_scale=3.0, seed=1, every=1, fps=16)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    (path,) = observer.sample(7, adapter)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(adapter.transformer_for(e).training for e in adapter.experts)
    assert adapter.active == "high_noise"  # sampling ended on the low-noise expert; the training one is back
    assert path.name == "step_000007_00.mp4" and path.stat().st_size > 0
    observer.sample(8, adapter)
    # the frames handed to the encoder (H.264 itself need not encode equal frames to equal bytes)
    assert np.array_equal(written["step_000007_00.mp4"], written["step_000008_00.mp4"])


def test_frame_strip_picks_evenly_spaced_frames():
    frames = np.stack([np.full((2, 3, 3), i, dtype=np.uint8) for i in range(17)])
    strip = samples_module.frame_strip(frames, count=5)
    assert strip.shape == (2, 15, 3)
    assert [int(strip[0, 3 * k, 0]) for k in range(5)] == [0, 4, 8, 12, 16]


def test_check_adds_the_sampling_footprint_to_the_memory_plan(tmp_path, capsys, monkeypatch):
    from tests.test_end_to_end import copy_examples
    from wantrain.cli.main import main

    # The real A14B weights are not on this machine: skip `check`'s model-file check, keep its estimate.
    monkeypatch.setattr("wantrain.app.preflight.check_model_files", lambda model: None)

    config = copy_examples(tmp_path, validation_and_samples=True)
    assert main(["check", str(config), "--set", "model.variant=t2v-a14b", "--set", "sample.width=832",
                 "--set", "sample.height=480", "--set", "sample.frames=81"]) == 0
    out = capsys.readouterr().out
    training, sampling = (float(v) for v in re.findall(r"tensors at the peak +([\d.]+) GiB", out))
    assert "sampling ([sample] 832x480x81, guidance; no autograd):" in out
    assert 27 < sampling < training  # one 14B expert in bf16 is ~27 GiB; sampling keeps no activations for backward
    assert main(["check", str(config), "--set", "sample.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert "[sample]" not in out and len(re.findall("tensors at the peak", out)) == 1
