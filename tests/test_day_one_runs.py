"""Whole runs of the tiny model with what peers' users reach for on day one (issue 27): caption dropout and
variants resumed byte-exact, epochs resolved to steps as `wantrain check` prints them, a LoRA started from a file
with lr = 0 exporting that file, LoRA+ groups in the metrics, the LR finder and a byte-exact resume, and a
metadata-file dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from wantrain.app.train import train
from wantrain.cli.main import main
from wantrain.core.errors import ConfigError, UserError
from wantrain.data.demo import render

BASE = """
[run]
output_dir = "runs"
name = "t"
seed = 0

[model]
variant = "tiny-t2v"
gradient_checkpointing = false
switch_every = 2

[lora]
rank = 4

[data]
path = "data"
resolutions = [32]
frames = [1]

[train]
max_steps = 8
log_every = 1
batch_size = 2
device = "cpu"

[optimizer]
lr = 3e-3

[observers]
tensorboard = false
progress = false
memory_probe = false
"""


def workspace(tmp_path: Path, *, images: int = 6, captions: str | None = None) -> Path:
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        colour = (40 * i % 255, 90, 200)
        Image.fromarray(render("square", colour, (0, 0, 0), "right", 32, 32, 1)[0]).save(data / f"i{i}.png")
        text = captions.format(i=i) if captions else f"a blue square {i}"
        (data / f"i{i}.txt").write_text(text)
    config = tmp_path / "run.toml"
    config.write_text(BASE)
    return config


def run_dir_of(outcome) -> Path:
    return Path(outcome.run_dir)


def loras(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("t_*.safetensors")) if "step" not in p.name}


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_caption_dropout_and_variants_is_byte_exact(tmp_path):
    config = workspace(tmp_path, captions="a blue square {i}\nsquare {i}, blue\nblue on black")
    sets = ["data.caption_dropout=0.3", 'data.caption_variants="lines"', 'data.caption_prefix="ohwx, "',
            "train.save_every=4"]
    full = train(config, overrides=sets)
    assert full.status == "completed"
    reference = loras(run_dir_of(full))
    checkpoint = run_dir_of(full) / "checkpoints" / "step_000004"
    resumed = train(config, overrides=sets, resume=checkpoint)
    assert resumed.status == "completed" and resumed.run_dir == full.run_dir
    assert loras(run_dir_of(resumed)) == reference
    other = train(config, overrides=[s for s in sets if "dropout" not in s] + ["data.caption_dropout=0.9"])
    assert loras(run_dir_of(other)) != reference  # the draws matter: the comparison above can fail


def test_max_epochs_trains_the_steps_check_prints(tmp_path, capsys):
    config = workspace(tmp_path, images=5)  # 5 samples, batch 2, carry: epochs of 2, 3, 2, ... micro-batches
    sets = ["train.max_steps=1", "train.grad_accum=2"]
    with pytest.raises(ConfigError, match="'train.max_steps' = 1 and 'train.max_epochs' = 3 are both set"):
        train(config, overrides=[*sets, "train.max_epochs=3"])
    epochs = ["train.grad_accum=2", "train.max_epochs=3", "train.save_every_epochs=1", "observers.jsonl=true"]
    text = config.read_text().replace("max_steps = 8\n", "")
    config.write_text(text)
    assert main(["check", str(config), *[a for s in epochs for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "epochs: the first is 1 optimizer steps (micro-batches per epoch: 2, 3, 2; grad_accum 2)" in out
    assert "train.max_epochs = 3 -> train.max_steps = 4" in out  # ceil((2 + 3 + 2) / 2)
    assert "train.save_every_epochs = 1 -> train.save_every = 1" in out
    assert main(["schedule", str(config), "--out", str(tmp_path / "lr.png"),
                 *[a for s in epochs for a in ("--set", s)]]) == 0
    assert "over 4 optimizer steps" in capsys.readouterr().out
    outcome = train(config, overrides=epochs)
    assert outcome.status == "completed" and outcome.steps == 4
    saved = json.loads((run_dir_of(outcome) / "preflight.json").read_text())
    assert saved["epochs"]["max_epochs"] == {"epochs": 3, "steps": 4}
    kept = (run_dir_of(outcome) / "config.toml").read_text()
    assert "max_epochs = 3" in kept and "max_steps" not in kept  # the run keeps the user's keys


def test_a_run_started_from_a_lora_file_with_lr_zero_exports_that_file(tmp_path):
    config = workspace(tmp_path)
    first = train(config, overrides=["train.max_steps=4"])
    source = run_dir_of(first)
    files = {e: source / f"t_{e}.safetensors" for e in ("high_noise", "low_noise")}
    text = config.read_text().replace("rank = 4\n", "")
    config.write_text(text)
    again = train(config, overrides=["optimizer.lr=0.0", "train.max_steps=4", "run.name=\"u\"",
                                     f'lora.init_from_high_noise="{files["high_noise"]}"',
                                     f'lora.init_from_low_noise="{files["low_noise"]}"'])
    assert again.status == "completed"
    for expert, path in files.items():
        want, got = load_file(path), load_file(run_dir_of(again) / f"u_{expert}.safetensors")
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), expert
    with pytest.raises(UserError, match="lora.rank = 8 disagrees with lora.init_from_high_noise"):
        train(config, overrides=["lora.rank=8", f'lora.init_from_high_noise="{files["high_noise"]}"'])
    assert not (tmp_path / "runs" / "refused").exists()


def test_loraplus_groups_are_in_the_metrics_and_resume_byte_exact(tmp_path):
    config = workspace(tmp_path)
    sets = ["lora.plus_lr_ratio=4.0", "model.lr_low_noise=1e-3", "train.save_every=4"]
    full = train(config, overrides=sets)
    lines = [m for m in metric_lines(run_dir_of(full)) if "train/lr/high_noise_B" in m]
    assert lines
    for m in lines:
        assert m["train/lr/high_noise_B"] == pytest.approx(4 * m["train/lr/high_noise"])
        assert m["train/lr/low_noise_B"] == pytest.approx(4 * m["train/lr/low_noise"])
    assert lines[0]["train/lr/low_noise"] == pytest.approx(1e-3)
    reference = loras(run_dir_of(full))
    resumed = train(config, overrides=sets, resume=run_dir_of(full) / "checkpoints" / "step_000004")
    assert loras(run_dir_of(resumed)) == reference


def test_the_lr_finder_sweeps_the_b_groups_at_the_ratio(tmp_path):
    config = workspace(tmp_path)
    outcome = train(config, overrides=["lora.plus_lr_ratio=8.0", "lr_finder.enabled=true", "lr_finder.steps=5",
                                       "lr_finder.steps_per_lr=1", "lr_finder.burn_in=2",
                                       "observers.jsonl=true"])
    lines = metric_lines(run_dir_of(outcome))
    assert len(lines) >= 5
    for m in lines:
        assert m["train/lr/high_noise_B"] == pytest.approx(8 * m["train/lr/high_noise"])
    assert len({m["train/lr/high_noise"] for m in lines[:5]}) == 5  # the sweep moved the A group's LR


def test_a_metadata_file_dataset_trains(tmp_path):
    config = workspace(tmp_path)
    data = tmp_path / "data"
    (data / "list.jsonl").write_text("\n".join(
        [json.dumps({"path": f"i{i}.png", "caption": [f"square {i}", "a square"]}) for i in range(6)]
        + ['{"path": "missing.png", "caption": "x"}']) + "\n")
    for txt in data.glob("*.txt"):
        txt.unlink()
    shutil.copy(config, tmp_path / "meta.toml")
    text = (tmp_path / "meta.toml").read_text().replace('path = "data"', 'metadata = "data/list.jsonl"')
    (tmp_path / "meta.toml").write_text(text)
    outcome = train(tmp_path / "meta.toml", overrides=["train.max_steps=2"])
    assert outcome.status == "completed"
    report = json.loads((run_dir_of(outcome) / "preflight.json").read_text())
    assert [s["reason"] for s in report["skipped"]] == [f"line 7: {data / 'missing.png'} does not exist"]
    assert report["captions"]["distinct_texts"] == 7


def test_validation_and_sample_intervals_in_epochs_resolve_to_steps(tmp_path):
    from wantrain.app.config import load_config
    from wantrain.app.epochs import resolve_epochs
    from wantrain.app.preflight import dataset

    config = workspace(tmp_path, images=5)  # epochs of 2, 3, 2 micro-batches at batch 2
    cfg = load_config(config, ["validation.every_epochs=2", "sample.every_epochs=1", "train.save_every_epochs=3"])
    data = dataset(cfg)
    resolved = resolve_epochs(cfg, data)
    assert (resolved.validation.every, resolved.sample.every, resolved.train.save_every) == (5, 2, 7)
    assert resolved.train.max_steps == 8  # given in steps: unchanged
    assert data.report.epochs["validation.every_epochs"] == {"epochs": 2, "steps": 5}
    assert "validation.every_epochs = 2 -> validation.every = 5" in data.report.format()
