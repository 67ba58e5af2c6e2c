"""Every way `wantrain run` can refuse a config refuses before anything is written: one line, exit code 2, no run
directory, no cache entry (issue 17.2). And the natural smoke test, `--max-steps 1`, trains one step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_end_to_end import copy_examples

from wantrain.cli.main import main

REFUSALS = {
    "unknown key": ["--set", "train.max_stepz=3"],
    "wrong type": ["--set", "train.max_steps='ten'"],
    "out of range": ["--set", "train.log_every=0"],
    "run.name escaping the run directory": ["--set", 'run.name="../../escaped"'],
    "empty run.name": ["--set", 'run.name=""'],
    "run id with a separator": ["--run-id", "a/b"],
    "seed too large": ["--set", "run.seed=18446744073709551616"],
    "integer warmup as long as the run": ["--max-steps", "4", "--set", "lr_scheduler.warmup_steps=4"],
    "external scheduler with a wrong argument": [
        "--set", 'lr_scheduler.type="external"', "--set", 'lr_scheduler.class_path="torch.optim.lr_scheduler.StepLR"',
        "--set", "lr_scheduler.step_sise=3"],
    "optimizer with a wrong keyword": ["--set", "optimizer.betas3=0.9"],
    "unknown optimizer type": ["--set", 'optimizer.type="adamw9bit"'],
    "observer that cannot be imported": ["--set", 'observers.extra=["no_such_module:Watch"]', "--allow-code"],
    "users' observer without --allow-code": ["--set", 'observers.extra=["my_observers:Watch"]'],
    "external optimizer with only allow_external_code": [
        "--set", 'optimizer.type="external"', "--set", 'optimizer.class="my_optim.SGD"',
        "--set", "optimizer.allow_external_code=true"],
    "missing data folder": ["--set", 'data.path="no_such_folder"'],
    "missing model folder": ["--set", 'model.path="no_such_model"'],
    "fp8 on a CPU": ["--set", 'model.base_dtype="fp8"', "--set", 'train.device="cpu"'],
    "CUDA without a GPU": ["--set", 'train.device="cuda"'],
    "nothing to resume from": ["--resume", "auto"],
    "a resume path that does not exist": ["--resume", "no_such_run"],
    "alpha schedule with one phase": [
        "--set", "lora.alpha_schedule.enabled=true",
        "--set", 'lora.alpha_schedule.phases=[{name="only", alpha=4, min_steps=5}]'],
    "preserve_output with Prodigy": [
        "--set", 'optimizer.type="prodigy"', "--set", "optimizer.lr=1.0",  # the quickstart's lora.alpha is 4
        "--set", "lora.alpha_schedule.enabled=true",
        "--set", 'lora.alpha_schedule.phases=[{name="a", alpha=4}, {name="b", alpha=8}]'],
}


@pytest.mark.parametrize("args", REFUSALS.values(), ids=REFUSALS.keys())
def test_every_refusal_happens_before_the_run_directory_and_the_cache_exist(tmp_path, capsys, args):
    config = copy_examples(tmp_path)
    code = main(["run", str(config), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert err.startswith("wantrain run: error: ") and "Traceback" not in err
    # one line, or several problems of the config under their count, one line each (an external scheduler with a
    # wrong argument: the example's warmup, which type = "external" does not take, is named too)
    assert len(lines) == 1 or (" problems in the config, all of them:" in lines[0]
                               and all(line.startswith("  [") for line in lines[1:])), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not list((tmp_path / "demo_data").rglob("*.safetensors"))  # no cache entry was written


@pytest.mark.slow
def test_a_one_step_smoke_run_of_the_quickstart_trains_and_saves(tmp_path):
    config = copy_examples(tmp_path)
    assert main(["run", str(config), "--max-steps", "1", "--set", "observers.progress=false"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run_dir / "quickstart_high_noise.safetensors").stat().st_size > 0
    assert Path(run_dir / "checkpoints" / "step_000001" / "complete.json").exists()


def test_an_extra_observer_needing_a_capability_the_model_lacks_is_refused_before_the_run_directory(tmp_path, capsys):
    config = copy_examples(tmp_path)
    (config.parent / "needy_observers.py").write_text(
        "from typing import Protocol, runtime_checkable\n"
        "from wantrain.observers import Observer\n\n"
        "@runtime_checkable\n"
        "class Teleporting(Protocol):\n"
        "    def teleport(self) -> None: ...\n\n"
        "class Needy(Observer):\n"
        "    needs = (Teleporting,)\n",
        encoding="utf-8")
    code = main(["run", str(config), "--set", 'observers.extra=["needy_observers:Needy"]', "--allow-code"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Needy" in err and "Teleporting" in err and "teleport" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
