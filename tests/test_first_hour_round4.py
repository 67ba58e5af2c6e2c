"""The first hour, round 4 (issue 49): `--resume auto` never takes over another run, a plan before the weights are
downloaded, moving from musubi-tuner in one pass, and messages that say only what is true."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import safetensors.torch

from tests.test_day_one_runs import workspace
from tests.test_end_to_end import copy_examples
from wantrain.cli.main import main

CHECKPOINTS = ["--set", "checkpoint.every=2"]
NAN_STREAK = ["--set", "faults.nan_at_steps=[3, 4]", "--set", "train.max_consecutive_nan=2"]


def lora_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("*.safetensors"))}


def test_resume_auto_continues_only_an_unfinished_run_of_the_same_config_file_and_run_id(tmp_path, capsys):
    config = workspace(tmp_path)
    assert main(["run", str(config), "--max-steps", "4", *CHECKPOINTS]) == 0
    (done,) = (tmp_path / "runs").iterdir()
    assert main(["run", str(config), "--run-id", "alpha", *CHECKPOINTS, *NAN_STREAK]) == 1  # failed at step 4
    (alpha,) = [d for d in (tmp_path / "runs").iterdir() if d != done]
    assert "the last good checkpoint is kept (step 2; --resume auto continues from it)" in capsys.readouterr().err
    finished = lora_bytes(done)

    # the newest run of this file without a run id completed: refused, naming it and how to go on on purpose
    assert main(["run", str(config), "--max-steps", "6", *CHECKPOINTS, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"'{done}', completed at step 4" in err and f"--resume '{done}' --max-steps N" in err, err
    assert "Traceback" not in err and lora_bytes(done) == finished

    # another config file (a copy): none of these runs is its own
    other = tmp_path / "other.toml"
    shutil.copy(config, other)
    assert main(["run", str(other), "--run-id", "alpha", *CHECKPOINTS, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"no complete checkpoint of a run named 't' (run id 'alpha', config file '{other}') left unfinished" in err

    # the unfinished run of this id, with another LR: only on purpose (the run directory named)
    assert main(["run", str(config), "--run-id", "alpha", *CHECKPOINTS, "--set", "optimizer.lr=1e-3",
                 "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.lr: 0.003 -> 0.001" in err and f"pass --resume '{alpha}'" in err, err

    # the same config and id: picked, and named before anything loads
    assert main(["run", str(config), "--run-id", "alpha", *CHECKPOINTS, "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "resume_auto_picked" in err and f"run_dir={alpha}" in err, err
    assert err.index("resume_auto_picked") < err.index("cache_ready")
    logged = [json.loads(x) for x in (alpha / "log.jsonl").read_text().splitlines()]
    assert [x["status"] for x in logged if x["event"] == "run_ended"] == ["failed", "completed"]
    assert lora_bytes(done) == finished


def test_a_failure_before_the_first_checkpoint_says_there_is_nothing_to_resume_and_a_full_disk_exits_1(
        tmp_path, capsys, monkeypatch):
    config = workspace(tmp_path)
    assert main(["run", str(config), "--set", "faults.nan_at_steps=[1, 2]", "--set", "train.max_consecutive_nan=2",
                 "--set", "checkpoint.every=4"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint was written before it, so there is nothing to resume from" in err, err
    assert "the last good checkpoint is kept" not in err

    def full_disk(tensors, filename, metadata=None):  # the first checkpoint's tensors
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["run", str(config), *CHECKPOINTS]) == 1  # failed (README's exit codes), not "bad input"
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("wantrain run: error: cannot write checkpoint") and "No space left on device" in err, err
    assert "no checkpoint was saved before this one, so there is nothing to resume from" in err
    assert "intact" not in err


def test_check_plans_memory_before_the_weights_are_downloaded_and_names_every_missing_file(tmp_path, capsys):
    config = workspace(tmp_path)
    files = {"high_noise_file": "w/high.safetensors", "low_noise_file": "w/low.safetensors",
             "vae_file": "w/vae.safetensors", "text_encoder_file": "w/umt5.safetensors", "tokenizer_path": "w/tok"}
    sets = ["--set", "model.variant='t2v-a14b'", "--set", "model.gradient_checkpointing=true",
            "--set", "model.host_ram_budget_gb=96"]
    for key, value in files.items():
        sets += ["--set", f"model.{key}='{tmp_path / value}'"]
    assert main(["check", str(config), *sets]) == 2
    captured = capsys.readouterr()
    assert "memory plan for 32x32x1" in captured.out and "card needs" in captured.out, captured.out
    assert "host memory (RAM), part by part" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("wantrain check: error: 5 model files missing: "), err
    for key, value in files.items():
        assert f"model.{key} '{tmp_path / value}' does not exist" in err
        assert f"problem: model.{key} '{tmp_path / value}' does not exist" in captured.out
    assert not (tmp_path / "runs").exists()

    assert main(["check", str(config), "--set", "model.variant='ti2v-5b'", "--set", "model.host_ram_budget_gb=96"]) == 2
    captured = capsys.readouterr()
    assert "model.path is required for ti2v-5b" in captured.err and "card needs" in captured.out


def test_videos_shorter_than_every_frame_bucket_are_warned_by_count_and_share(tmp_path, capsys):
    config = copy_examples(tmp_path)  # 16 clips of 10-22 frames at 16 fps, 4 images
    assert main(["check", str(config), "--set", "data.frames=[1, 25, 45]"]) == 0
    out = capsys.readouterr().out
    assert ("warning: 16 of 16 videos (100 %) are shorter than every frame bucket above 1 (the shortest is 25 "
            "frames; they have 10-22 after retiming) and train as single frames: add a bucket they reach, e.g. "
            "data.frames = [1, 9, 25, 45]") in out, out
    assert main(["check", str(config)]) == 0  # the quickstart's 9 frames: no such warning
    assert "train as single frames" not in capsys.readouterr().out
