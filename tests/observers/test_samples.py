"""Sample videos written during training equal what diffusers' own pipeline makes from the saved LoRA files."""

from __future__ import annotations

import json
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


SECOND = dict(prompt="a green ball", width=48, height=32, frames=9, seed=11, steps=2, guidance_scale=1.5,
              guidance_scale_high_noise=2.5, negative_prompt="rain")
"""A prompt with options of its own: another size, frame count, seed, steps, guidance per expert, negative."""


def random_lora_file(path: Path, expert: str) -> Path:
    """A LoRA file of ``expert`` (tiny-t2v, rank 4) with random A and B, written by wantrain's own saver."""
    from tests.models.wan22_helpers import make_adapter
    from wantrain.models.wan22.export import lora_layers

    adapter = make_adapter("tiny-t2v", experts=expert, gradient_checkpointing=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, layer in lora_layers(adapter.transformer_for(expert)):
            weight = layer.lora_B["wantrain"].weight
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.2)
    (written,) = adapter.saver(path.parent, path.stem).save(0, final=True)
    return Path(written)


@pytest.mark.slow
def test_one_trained_expert_and_a_prompts_own_options_sample_what_diffusers_makes(tmp_path, monkeypatch):
    """experts = "low_noise": the high-noise steps run its base weights plus `sample.other_expert_lora`; a second
    prompt sets its own size, frames, seed, steps, guidance and negative prompt. Both videos equal diffusers'
    pipeline from the model folder with the two LoRA files loaded, and the mp4s hold each prompt's size and frame
    count (read back with PyAV)."""
    import av
    import diffusers

    model_dir = tmp_path / "model"
    write_tiny_diffusers_dir(VARIANTS["tiny-t2v"], 7, model_dir)
    other = random_lora_file(tmp_path / "other" / "earlier.safetensors", "high_noise")
    second = "{ " + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in SECOND.items()) + " }"
    config = write_config(tmp_path, "tiny-t2v", model_dir, image=False, extra=f'other_expert_lora = "{other}"')
    text = config.read_text().replace(f'prompts = ["{PROMPT}"]', f'prompts = ["{PROMPT}", {second}]')
    config.write_text(text.replace("switch_every = 1\n", 'switch_every = 1\nexperts = "low_noise"\n'))
    written = record_videos(monkeypatch)
    outcome = prepare(load_config(config)).execute()
    assert outcome.status == "completed"
    assert sorted(written) == ["step_000000_00.mp4", "step_000000_01.mp4", "step_000004_00.mp4",
                               "step_000004_01.mp4"]
    assert [Path(p).name for p in outcome.saved if "_step" not in Path(p).name] == ["s_low_noise.safetensors"]

    pipe = diffusers.WanPipeline.from_pretrained(str(model_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(other))
    pipe.load_lora_weights(str(outcome.run_dir / "s_low_noise.safetensors"), load_into_transformer_2=True)
    common = dict(max_sequence_length=VARIANTS["tiny-t2v"].text_len, output_type="np")
    first = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=32, num_frames=5, num_inference_steps=3,
                 guidance_scale=2.0, generator=torch.Generator().manual_seed(5), **common).frames[0]
    own = pipe(prompt=SECOND["prompt"], negative_prompt=SECOND["negative_prompt"], height=32, width=48,
               num_frames=9, num_inference_steps=2, guidance_scale=2.5, guidance_scale_2=1.5,
               generator=torch.Generator().manual_seed(11), **common).frames[0]
    for name, reference in (("step_000004_00.mp4", first), ("step_000004_01.mp4", own)):
        diff = np.abs(written[name].astype(int) - samples_module.to_uint8(reference).astype(int)).max()
        print(f"{name}: max difference {diff} uint8 levels")
        assert diff <= TOLERANCE_LEVELS, name
    effect = np.abs(written["step_000004_00.mp4"].astype(int) - written["step_000000_00.mp4"]).max()
    assert effect > 4 * TOLERANCE_LEVELS  # the trained low-noise LoRA changed the video: the comparison bites

    for name, (frames, height, width) in (("step_000004_00.mp4", (5, 32, 32)), ("step_000004_01.mp4", (9, 32, 48))):
        with av.open(str(outcome.run_dir / "samples" / name)) as container:
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(decoded) == frames and decoded[0].shape == (height, width, 3), name
    # the latents beside each video change as the LoRA learns (the tiny VAE's frames are noise either way)
    from PIL import Image

    before, after = (np.asarray(Image.open(outcome.run_dir / "samples" / f"step_00000{s}_00_latents.png"), dtype=int)
                     for s in (0, 4))
    assert before.shape == after.shape and np.abs(after - before).max() > 4
    log = [json.loads(x) for x in (outcome.run_dir / "log.jsonl").read_text().splitlines()]
    notes = {x.get("note") for x in log if x["event"] == "samples_written"}
    assert any(n and "random toy model" in n for n in notes)
    # and beside step 0's, with their difference and how far it moved: what the LoRA changed (issue 49)
    from wantrain.observers.evaluation.latents_change import CHANGE_GAIN, GAP, LABEL_HEIGHT, latents_change

    labelled = np.asarray(Image.open(outcome.run_dir / "samples" / "step_000004_00_change.png"), dtype=int)
    label, change = labelled[:LABEL_HEIGHT], labelled[LABEL_HEIGHT:]  # a strip naming the panels, then the panels
    width = before.shape[1]
    assert change.shape == (before.shape[0], 3 * width + 2 * GAP, 3)
    assert all((label[:, i * (width + GAP):(i + 1) * width + i * GAP] < 128).any() for i in range(3))  # text each
    assert (change[:, :width] == before).all() and (change[:, width + GAP:2 * width + GAP] == after).all()
    assert (change[:, -width:] == np.clip(128 + CHANGE_GAIN * (after - before), 0, 255)).all()
    assert not (outcome.run_dir / "samples" / "step_000000_00_change.png").exists()  # nothing to compare at 0
    figures = [x["latents_change"] for x in log if x["event"] == "samples_written" and "latents_change" in x]
    assert len(figures) == 1 and len(figures[0]) == 2 and min(figures[0]) > 0.01
    assert figures[0][0] == pytest.approx(latents_change(before, after, samples_module.LATENT_RANGE), abs=1e-4)


def test_a_lora_file_of_the_trained_expert_given_for_the_other_one_is_refused(tmp_path):
    from wantrain.core.errors import ConfigError

    wrong = random_lora_file(tmp_path / "lora" / "mine.safetensors", "low_noise")
    config = write_config(tmp_path, "tiny-t2v", tmp_path / "unused", image=False,
                          extra=f'other_expert_lora = "{wrong}"')
    config.write_text(config.read_text().replace(f'path = "{tmp_path / "unused"}"\n', 'experts = "low_noise"\n'))
    with pytest.raises(ConfigError, match="is a LoRA of the low_noise expert .* the expert this run does not train "
                                          "is high_noise"):
        prepare(load_config(config))
    assert not (tmp_path / "runs").exists()


def test_sampling_with_one_trained_expert_never_has_two_experts_on_the_device(tmp_path, monkeypatch):
    from tests.models.wan22_helpers import make_adapter
    from wantrain.observers.evaluation.samples import SampleJob, SampleVideos

    record_videos(monkeypatch)
    adapter = make_adapter("tiny-t2v", experts="low_noise", gradient_checkpointing=False)
    # one real device here: a distinct (equivalent) offload device makes every placement decision visible
    adapter.offload_device = torch.device("cpu", 0)
    assert adapter.add_sampling_expert() == "high_noise"
    assert adapter.experts == ("low_noise",) and adapter.placement.where["high_noise"] == adapter.offload_device
    seen = []
    for expert in ("high_noise", "low_noise"):
        adapter.transformer_for(expert).register_forward_pre_hook(
            lambda module, args, expert=expert: seen.append((expert, dict(adapter.placement.where))))
    text = adapter.encode_text(["a red ball"])["text_embeds"]
    job = SampleJob(index=0, prompt_embeds=text, negative_embeds=None, width=32, height=32, frames=5, seed=1,
                    steps=6, guidance_scale=1.0, guidance_scale_high_noise=1.0)
    observer = SampleVideos(out_dir=tmp_path, jobs=[job], every=1, fps=16)
    observer.sample(3, adapter)
    assert {e for e, _ in seen} == {"high_noise", "low_noise"}  # both bands were sampled
    for expert, placement in seen:
        on_device = [e for e, d in placement.items() if d == adapter.device]
        assert on_device == [expert], (expert, placement)
    assert adapter.active == "low_noise" and adapter.placement.where["high_noise"] == adapter.offload_device
    assert adapter.trainable_parameters() == adapter.trainable_parameters("low_noise")  # nothing of it trains
    assert "high_noise" not in {k.split("/")[0] for k in adapter.state_dict()["weights"]}


def test_a_sampling_only_expert_with_block_swap_samples_the_same_video_and_leaves_no_block_behind(tmp_path,
                                                                                                  monkeypatch):
    from tests.models.wan22_helpers import make_adapter
    from wantrain.observers.evaluation.samples import SampleJob, SampleVideos

    written = record_videos(monkeypatch)
    for swapped in (0, 2):
        adapter = make_adapter("tiny-t2v", experts="low_noise", gradient_checkpointing=True, blocks_to_swap=swapped)
        adapter.offload_device = torch.device("cpu", 0)  # distinct from the training device: every move happens
        adapter.add_sampling_expert()
        swap = adapter.swap_for("high_noise")
        copies: list[int] = []
        if swapped:
            swap.on_copy = copies.append
        text = adapter.encode_text(["a red ball"])["text_embeds"]
        job = SampleJob(index=0, prompt_embeds=text, negative_embeds=None, width=32, height=32, frames=5, seed=1,
                        steps=6, guidance_scale=1.0, guidance_scale_high_noise=1.0)
        SampleVideos(out_dir=tmp_path / str(swapped), jobs=[job], every=1, fps=16).sample(swapped, adapter)
        if swapped:
            assert sorted(set(copies)) == list(swap.swapped) != []  # its swapped blocks ran through the ring
            assert swap.loaded == () and swap.live_blocks() == []  # released when it left the device
    assert np.array_equal(written["step_000000_00.mp4"], written["step_000002_00.mp4"])


def test_sampling_leaves_the_global_rng_and_train_mode_alone(tmp_path, monkeypatch):
    from tests.models.wan22_helpers import make_adapter
    from wantrain.observers.evaluation.samples import SampleJob, SampleVideos

    written = record_videos(monkeypatch)
    adapter = make_adapter("tiny-t2v", lora={"dropout": 0.2}, gradient_checkpointing=False)
    text = adapter.encode_text(["a red ball"])["text_embeds"]
    job = SampleJob(index=0, prompt_embeds=text, negative_embeds=text * 0, width=32, height=32, frames=5, seed=1,
                    steps=2, guidance_scale=3.0, guidance_scale_high_noise=3.0)
    observer = SampleVideos(out_dir=tmp_path, jobs=[job], every=1, fps=16)
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
    monkeypatch.setattr("wantrain.app.preflight.check_model_files", lambda model, **_: None)
    monkeypatch.setattr("wantrain.app.preflight.missing_model_files", lambda model: [])

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
