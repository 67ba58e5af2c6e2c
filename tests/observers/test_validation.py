"""Fixed-timestep validation loss: deterministic, on record in the metrics stream, and invisible to training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wantrain.app.assemble import prepare
from wantrain.app.config import load_config
from wantrain.core.errors import ConfigError, UserError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo_data"

BASE = """
[run]
output_dir = "runs"
name = "v"
seed = 3
[model]
variant = "{variant}"
switch_every = 2
gradient_checkpointing = false
[lora]
rank = 4
dropout = 0.1
[data]
path = "data"
resolutions = [32]
frames = [5]
[train]
max_steps = 6
log_every = 3
device = "cpu"
[optimizer]
lr = 1e-2
[lr_scheduler]
type = "constant"
[observers]
progress = false
"""

WATCHING = """
[validation]
enabled = true
path = "val"
every = 2
timesteps = [0.2, 0.5, 0.95]
seed = 11
[sample]
enabled = true
prompts = ["a magenta square"]
every = 3
frames = 5
width = 32
height = 32
steps = 2
guidance_scale = 2.0
"""


def write_run(tmp: Path, extra: str = "", variant: str = "tiny-t2v") -> Path:
    for folder, names in (("data", ("clip_000", "clip_001", "image_000")), ("val", ("clip_002", "image_001"))):
        (tmp / folder).mkdir(exist_ok=True)
        for name in names:
            for src in DEMO.glob(f"{name}.*"):
                shutil.copy(src, tmp / folder / src.name)
    config = tmp / "run.toml"
    config.write_text(BASE.format(variant=variant) + extra, encoding="utf-8")
    return config


def run(config: Path):
    outcome = prepare(load_config(config)).execute()
    assert outcome.status == "completed"
    lines = [json.loads(x) for x in (outcome.run_dir / "metrics.jsonl").read_text().splitlines()]
    return outcome, lines


def val_series(lines: list[dict]) -> dict[int, dict[str, float]]:
    return {x["step"]: {k: v for k, v in x.items() if k.startswith("val/")} for x in lines if "val/loss" in x}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three short runs with the same seed: without the observers, with them, and with them again."""
    out = {}
    for name, extra in (("plain", ""), ("watched", WATCHING), ("again", WATCHING)):
        out[name] = run(write_run(tmp_path_factory.mktemp(name), extra))
    return out


@pytest.mark.slow
def test_run_with_validation_trains_bitwise_like_a_run_without_it(runs):
    (plain, plain_lines), (watched, watched_lines) = runs["plain"], runs["watched"]

    # the training figures and the LoRA are bitwise the same (LoRA dropout 0.1: eval mode must keep it off)
    def train_losses(lines):
        return [(x["step"], x["train/loss"]) for x in lines if "train/loss" in x]

    assert train_losses(plain_lines) == train_losses(watched_lines) and len(train_losses(plain_lines)) == 2
    for a, b in zip(sorted(plain.saved), sorted(watched.saved), strict=True):
        ours, theirs = load_file(a), load_file(b)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    # val/ at step 0 (own line), every 2 steps (step 2 and 4: own lines; step 6: the log step's line) and the end
    series = val_series(watched_lines)
    assert sorted(series) == [0, 2, 4, 6]
    assert all("val/loss" not in x for x in plain_lines)
    for values in series.values():
        assert set(values) == {"val/loss", "val/loss/high_noise", "val/loss/low_noise", "val/loss/t_0.2",
                               "val/loss/t_0.5", "val/loss/t_0.95"}
        assert values["val/loss/high_noise"] == values["val/loss/t_0.95"]  # 0.95 >= boundary 0.875
    line_6 = next(x for x in watched_lines if x["step"] == 6)
    assert "train/loss" in line_6 and "val/loss" in line_6  # one line per log step
    assert series[6]["val/loss"] != series[0]["val/loss"]  # the LoRA trained
    assert sorted(p.name for p in (watched.run_dir / "samples").glob("*.mp4")) == [
        "step_000000_00.mp4", "step_000003_00.mp4", "step_000006_00.mp4"]
    assert len(list((watched.run_dir / "samples").glob("*_latents.png"))) == 3
    events = {json.loads(x)["event"] for x in (watched.run_dir / "log.jsonl").read_text().splitlines()}
    assert {"validation", "samples_written"} <= events  # their cost is in the run log


@pytest.mark.slow
def test_validation_loss_is_bitwise_repeatable_across_runs_with_the_same_seed(runs):
    first, second = val_series(runs["watched"][1]), val_series(runs["again"][1])
    assert first == second and len(first) == 4


def test_validation_leaves_the_global_rng_train_mode_and_active_expert_alone():
    from tests.models.wan22_helpers import make_adapter, raw_batch
    from wantrain.observers.evaluation.validation import validate

    adapter = make_adapter("tiny-t2v", lora={"dropout": 0.3}, gradient_checkpointing=False)
    adapter.activate("low_noise", None)
    batches = [adapter.encode_batch(raw_batch(seed=s)) for s in (0, 1)]
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = validate(adapter, batches, [0.1, 0.9], seed=2)
    again = validate(adapter, batches, [0.1, 0.9], seed=2)
    other_noise = validate(adapter, batches, [0.1, 0.9], seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert adapter.active == "low_noise" and all(adapter.transformer_for(e).training for e in adapter.experts)
    assert first == again and first != other_noise
    assert first["val/loss"] == pytest.approx((first["val/loss/t_0.1"] + first["val/loss/t_0.9"]) / 2)


def test_timesteps_of_an_untrained_expert_are_left_out():
    from tests.models.wan22_helpers import make_adapter, raw_batch
    from wantrain.observers.evaluation.validation import validate

    adapter = make_adapter("tiny-t2v", experts="low_noise", gradient_checkpointing=False)
    values = validate(adapter, [adapter.encode_batch(raw_batch())], [0.3, 0.9], seed=0)
    assert set(values) == {"val/loss", "val/loss/t_0.3"}


def test_a_padded_share_runs_as_many_forwards_as_the_longest_and_counts_only_its_own_clips():
    """Under fsdp and Ulysses every rank runs as many (collective) forwards: 3 clips over 2 ranks, the second rank
    evaluates its clip and one padding forward per timestep, whose loss counts nowhere."""
    from tests.models.wan22_helpers import make_adapter, raw_batch
    from wantrain.observers.evaluation.validation import evaluation_share, validate

    assert evaluation_share(3, 0, 2, in_step=True) == ([0, 2], 0)
    assert evaluation_share(3, 1, 2, in_step=True) == ([1], 1)
    assert evaluation_share(3, 1, 2, in_step=False) == ([1], 0)  # data parallel: no forward is a collective
    assert evaluation_share(1, 1, 2, in_step=True) == ([], 1)
    adapter = make_adapter("tiny-t2v", experts="low_noise", gradient_checkpointing=False)
    batches = [adapter.encode_batch(raw_batch(seed=s)) for s in (0, 1)]
    calls = []
    original = adapter.validation_loss
    adapter.validation_loss = lambda *a: calls.append(a) or original(*a)
    alone = validate(adapter, batches[1:], [0.3], seed=0, clip_indices=[1])
    assert len(calls) == 1
    padded = validate(adapter, batches[1:], [0.3], seed=0, clip_indices=[1], padding=[batches[0]])
    assert len(calls) == 3 and padded == alone  # the padding forward ran and changed no figure


@pytest.mark.parametrize(("extra", "variant", "expected"), [
    ("[validation]\nenabled = true\n", "tiny-t2v", "exactly one of 'validation.path'"),
    ("[validation]\nenabled = true\npath = 'nowhere'\n", "tiny-t2v", "'validation.path'"),
    ("[validation]\ntimesteps = [0.5, 1.0]\n", "tiny-t2v", "strictly between 0 and 1"),
    ("[sample]\nenabled = true\n", "tiny-t2v", "'sample.prompts' is empty"),
    ("[sample]\nenabled = true\nprompts = ['x']\nframes = 6\n", "tiny-t2v", r"4k\+1"),
    ("[sample]\nenabled = true\nprompts = ['x']\nwidth = 40\n", "tiny-t2v", "multiple of 16"),
    ("[sample]\nenabled = true\nprompts = [{prompt = 'x', frames = 6}]\n", "tiny-t2v",
     r"'sample.prompts\[0\].frames' = 6: use a count of the form 4k\+1"),
    ("[sample]\nenabled = true\nprompts = ['x', {prompt = 'y', widht = 32}]\n", "tiny-t2v",
     r"unknown config key 'sample.prompts\[1\].widht': did you mean 'sample.prompts\[1\].width'"),
    ("[sample]\nenabled = true\nprompts = [{prompt = 'x', width = 40}]\n", "tiny-t2v",
     r"'sample.prompts\[0\].width' = 40: tiny-t2v needs a multiple of 16"),
    ("[sample]\nenabled = true\nprompts = [{prompt = 'x', steps = 0}]\n", "tiny-t2v",
     r"'sample.prompts\[0\].steps' = 0 is out of range"),
    ("[sample]\nenabled = true\nprompts = [{prompt = 'x', image = 'a.png'}]\n", "tiny-t2v",
     r"'sample.prompts\[0\].image' is set but tiny-t2v is text-to-video"),
    ("[sample]\nenabled = true\nprompts = ['x']\nguidance_scale_high_noise = 2.0\n", "tiny-ti2v",
     "applies to the two-expert A14B variants"),
    ("[sample]\nenabled = true\nprompts = [{prompt = 'x', guidance_scale_high_noise = 1.0}]\nguidance_scale = 3.0\n",
     "tiny-t2v", "diffusers runs the negative pass only when the high-noise scale is above 1"),
    ("[sample]\nenabled = true\nprompts = ['x']\nother_expert_lora = 'run.toml'\n", "tiny-t2v",
     "is for a run that trains one expert"),
    ("[sample]\nenabled = true\nprompts = ['x']\nother_expert_lora = 'no.safetensors'\n", "tiny-t2v:low_noise",
     "'sample.other_expert_lora' = .* does not exist"),
    ("[sample]\nenabled = true\nprompts = ['x']\nother_expert_lora = 'run.toml'\n", "tiny-t2v:low_noise",
     "'sample.other_expert_lora' = .* is not a readable safetensors file"),
    ("[sample]\nenabled = true\nprompts = ['x']\nimages = ['a.png']\n", "tiny-t2v", "text-to-video"),
    ("[sample]\nenabled = true\nprompts = ['x']\nimages = ['missing.png']\n", "tiny-ti2v", "does not exist"),
    ("[sample]\nenabled = true\nprompts = ['x']\nimages = ['run.toml']\n", "tiny-ti2v", "not a readable image"),
])
def test_bad_validation_and_sample_settings_are_refused_before_the_run_directory(tmp_path, extra, variant, expected):
    variant, _, experts = variant.partition(":")  # "tiny-t2v:low_noise": one trained expert
    config = write_run(tmp_path, extra, variant=variant)
    with pytest.raises((ConfigError, UserError), match=expected):
        prepare(load_config(config, [f"model.experts={experts}"] if experts else []))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_resumed_run_with_validation_ends_bitwise_like_the_uninterrupted_one(runs, tmp_path):
    import wantrain

    config = write_run(tmp_path, WATCHING.split("[sample]")[0])
    first = wantrain.train(config, overrides=["train.max_steps=4"])
    assert first.status == "completed"
    resumed = wantrain.train(config, resume=first.run_dir)  # a completed run: continued on purpose
    assert resumed.status == "completed" and resumed.run_dir == first.run_dir
    uninterrupted, lines = runs["watched"]
    final = [p for p in resumed.saved if "_step" not in Path(p).name]
    reference = [p for p in uninterrupted.saved if "_step" not in Path(p).name]
    for a, b in zip(sorted(final), sorted(reference), strict=True):
        ours, theirs = load_file(a), load_file(b)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    resumed_lines = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert val_series(resumed_lines) == val_series(lines)  # steps 0, 2, 4 from the first part, 6 after resuming
