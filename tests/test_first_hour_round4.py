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
from tests.test_first_hour_round3 import AI_TOOLKIT as ROUND3_AI_TOOLKIT
from tests.test_first_hour_round3 import MUSUBI_DATASET
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


# -- moving from musubi-tuner or ai-toolkit in one pass ---------------------------------------------------------------
def test_every_config_problem_is_reported_at_once_each_with_its_mapping(tmp_path, capsys):
    config = workspace(tmp_path)
    text = config.read_text().replace("[lora]\nrank = 4", '[lora]\nrank = 0\nnetwork_module = "networks.lora_wan"')
    config.write_text(text.replace("max_steps = 8", 'max_steps = "eight"\nmixed_precision = "bf16"'))
    assert main(["check", str(config), "--network_dim", "32", "--learning_rate", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "--network_dim is musubi-tuner's argument; wantrain's is --set lora.rank=32" in err
    assert "--learning_rate is musubi-tuner's argument; wantrain's is --set optimizer.lr=1e-4" in err
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert "4 problems in the config, all of them:" in err, err
    assert "'network_module' is musubi-tuner's name; wantrain's key for it is 'lora.type'" in err
    assert "config key 'train.max_steps' = 'eight' has the wrong type; expected an integer" in err
    assert "'mixed_precision' is musubi-tuner's; wantrain needs no key for it" in err
    assert "config key 'lora.rank'" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


MUSUBI_ARGS = """
task = "t2v-A14B"
dit = "/w/low.safetensors"
dit_high_noise = "/w/high.safetensors"
network_module = "networks.lora_wan"
network_dim = 32
network_alpha = 16
learning_rate = 2e-4
max_train_steps = 1000
mixed_precision = "bf16"
timestep_sampling = "shift"
discrete_flow_shift = 3.0
min_timestep = 100
seed = 42
output_name = "mylora"
dataset_config = "dataset.toml"
weird_flag = 1
"""

AI_TOOLKIT = ROUND3_AI_TOOLKIT + """      train:
        steps: 2000
        lr: 1e-4
        batch_size: 1
      sample:
        sample_every: 250
        num_frames: 41
"""

def test_convert_writes_a_wantrain_config_from_musubi_and_ai_toolkit_naming_each_key_it_could_not_map(tmp_path,
                                                                                                      capsys):
    from wantrain.app.config import load_config

    (tmp_path / "args.toml").write_text(MUSUBI_ARGS)
    (tmp_path / "dataset.toml").write_text(MUSUBI_DATASET)
    out = tmp_path / "converted.toml"
    assert main(["convert", str(tmp_path / "args.toml"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    for key in ('mixed_precision = "bf16": left out', "weird_flag = 1: no wantrain key known"):
        assert f"wantrain convert: not mapped: {key}" in err, err
    assert "lora.rank" not in err and "dataset_config" not in err  # mapped, and the dataset read
    cfg = load_config(out)
    assert (cfg.model.variant, cfg.lora.rank, cfg.lora.alpha, cfg.optimizer.lr) == ("t2v-a14b", 32, 16, 2e-4)
    # musubi-tuner's "shift" draws sigmoid(N(0, sigmoid_scale)) and shifts it by discrete_flow_shift
    assert (cfg.model.timestep_sampling, cfg.model.shift, cfg.model.min_t) == ("sigmoid", 3.0, 0.1)
    assert (cfg.train.max_steps, cfg.run.seed, cfg.run.name, cfg.train.batch_size) == (1000, 42, "mylora", 1)
    assert (str(cfg.data.path), list(cfg.data.frames), cfg.data.repeats) == ("/data/clips", [1, 25, 45], 2)
    assert str(cfg.model.high_noise_file) == "/w/high.safetensors"
    assert main(["convert", str(tmp_path / "args.toml"), "-o", str(out)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err

    (tmp_path / "train.yaml").write_text(AI_TOOLKIT)
    assert main(["convert", str(tmp_path / "train.yaml"), "-o", str(tmp_path / "from_yaml.toml")]) == 0
    cfg = load_config(tmp_path / "from_yaml.toml")
    assert (cfg.run.name, cfg.data.caption_prefix, cfg.lora.rank, cfg.lora.alpha) == ("my_lora", "p3r5on, ", 32, 32)
    assert (str(cfg.data.path), cfg.data.tag_shuffles, cfg.train.max_steps, cfg.optimizer.lr) == (
        "/path/to/clips", 0, 2000, 1e-4)
    assert (cfg.sample.every, cfg.sample.frames) == (250, 41)


# -- a LoRA of another trainer ---------------------------------------------------------------------------------------
def test_inspect_lora_reads_every_format_init_from_reads_and_the_run_logs_what_it_loaded(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "models"))  # its helpers import as the models tests do
    from tests.models.test_wan22_init_from import write_format

    config = workspace(tmp_path)
    assert main(["run", str(config), "--max-steps", "2", "--set", "lora.alpha=2"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    ours = run_dir / "t_low_noise.safetensors"
    musubi = write_format(ours, tmp_path / "theirs_musubi.safetensors", "musubi")
    diffusers = write_format(ours, tmp_path / "theirs_diffusers.safetensors", "diffusers")
    capsys.readouterr()
    for path, says in ((ours, "format: wantrain / ComfyUI"), (musubi, "format: musubi-tuner (kohya"),
                       (diffusers, "format: diffusers / peft")):
        assert main(["inspect-lora", str(path)]) == 0
        out = capsys.readouterr().out
        assert says in out and "self_attn: rank 4, alpha 2" in out and "cross_attn: rank 4, alpha 2" in out, out

    assert main(["run", str(config), "--max-steps", "2", "--set", "model.experts='low_noise'",
                 "--set", f"lora.init_from='{musubi}'", "--set", "lora.rank=4"]) == 0
    (started,) = [d for d in (tmp_path / "runs").iterdir() if d != run_dir]
    logged = [json.loads(x) for x in (started / "log.jsonl").read_text().splitlines()]
    (loaded,) = [x for x in logged if x["event"] == "lora_init_loaded"]
    assert loaded["format"].startswith("musubi-tuner") and loaded["path"] == str(musubi), loaded
    assert (loaded["key"], loaded["expert"], loaded["rank"], loaded["alpha"], loaded["modules"]) == (
        "lora.init_from", "low_noise", 4, [2.0], 20)
