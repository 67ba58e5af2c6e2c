"""Whole runs of each ``lora.type`` (the quickstart: tiny-t2v, both experts, an expert switch every 3 steps, block
swap and gradient checkpointing on, validation and samples): each trains and exports its LyCORIS keys, a run
killed with SIGKILL after its first checkpoint resumes with ``--resume auto`` to files byte-equal to an
uninterrupted run, and ``wantrain inspect-lora`` names the type. The LR finder and the alpha schedule run with a
non-LoRA type too (torchrun with a DoRA: tests/test_distributed_launch.py's two-node run)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import prewarmed
import pytest
from inprocess import wantrain
from safetensors.torch import load_file
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

SETTINGS = ["train.max_steps=8", "train.log_every=2", "train.save_every=8", "checkpoint.every=4",
            "observers.progress=false", "optimizer.lr=3e-3", "model.gradient_checkpointing=true",
            "model.switch_every=3", "model.blocks_to_swap=1", "validation.every=4", "sample.every=8", "sample.steps=2"]
TYPE_KEYS = {"lokr": "lokr_w1", "loha": "hada_w1_a", "dora": "dora_scale"}


def run(config: Path, out: Path, *extra: str, resume: bool = False) -> subprocess.CompletedProcess:
    """A run of the quickstart; one that is killed (``faults.kill_at_steps``) in a process of its own, the others in
    this one (``tests/inprocess.py``)."""
    args = ["run", str(config), "--set", f"run.output_dir={out}"]
    for item in [*SETTINGS, *extra]:
        args += ["--set", item]
    args += ["--resume", "auto"] if resume else []
    if not any(item.startswith("faults.kill_at_steps") for item in extra):
        return wantrain(*args)
    return prewarmed.run(["-m", "wantrain", *args], capture_output=True, text=True, timeout=600)


def only_run_dir(out: Path) -> Path:
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return run_dir


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(only_run_dir(out).glob("quickstart*.safetensors"))}


@pytest.mark.parametrize("kind", list(TYPE_KEYS))
def test_each_type_trains_the_quickstart_and_resumes_after_sigkill_to_byte_equal_files(kind, tmp_path, capsys):
    evaluation = kind == "dora"  # validation and samples on one type only (their cost); DoRA reads the base weights
    config = copy_examples(tmp_path, validation_and_samples=evaluation)
    done = run(config, tmp_path / "straight", f'lora.type="{kind}"')
    assert done.returncode == 0, done.stderr
    reference = files(tmp_path / "straight")
    assert set(reference) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    run_dir = only_run_dir(tmp_path / "straight")
    if evaluation:
        assert list((run_dir / "samples").glob("*.mp4")), "no sample was written"
        assert "val/loss" in (run_dir / "metrics.jsonl").read_text()
    for name in reference:
        tensors = load_file(str(run_dir / name))
        assert any(k.endswith(f".{TYPE_KEYS[kind]}") for k in tensors), sorted(tensors)[:4]
        assert main(["inspect-lora", str(run_dir / name)]) == 0
        assert {"lokr": "type: LoKr", "loha": "type: LoHa", "dora": "type: DoRA"}[kind] in capsys.readouterr().out

    killed = run(config, tmp_path / "killed", f'lora.type="{kind}"', "faults.kill_at_steps=[6]")
    assert killed.returncode == -9, killed.stderr
    assert (only_run_dir(tmp_path / "killed") / "checkpoints" / "step_000004" / "complete.json").exists()
    assert not files(tmp_path / "killed")
    resumed = run(config, tmp_path / "killed", f'lora.type="{kind}"', resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert files(tmp_path / "killed") == reference


def _workspace(tmp: Path) -> Path:
    config = copy_examples(tmp)
    assert main(["cache", str(config)]) == 0
    return config


def test_the_lr_finder_sweeps_a_lokr(tmp_path):
    config = _workspace(tmp_path)
    code = main(["run", str(config), "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", 'lora.type="lokr"',
                 "--set", "lr_finder.enabled=true", "--set", "lr_finder.steps=5", "--set", "lr_finder.steps_per_lr=1",
                 "--set", "lr_finder.burn_in=2", "--set", "observers.progress=false"])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "lr_finder.json").read_text())
    assert summary, "the sweep wrote no summary"


SCHEDULE = """
[lora.alpha_schedule]
enabled = true
window = 10
min_samples = 5
[[lora.alpha_schedule.phases]]
name = "foundation"
alpha = 4
min_steps = 10
loss_improvement_rate_below = 1e3
max_loss_cv = 10.0
min_gradient_stability = 0.0
[[lora.alpha_schedule.phases]]
name = "balance"
alpha = 7
"""


def test_the_alpha_schedule_changes_a_loha_alpha_and_the_export_carries_it(tmp_path):
    config = _workspace(tmp_path)
    text = config.read_text()
    text = re.sub(r"\[lora\]\nrank = 8\nalpha = 4[^\n]*\n", '[lora]\nrank = 8\ntype = "loha"\n', text)
    config.write_text(text + SCHEDULE)
    code = main(["run", str(config), "--max-steps", "40", "--set", f"run.output_dir={tmp_path / 'runs'}",
                 "--set", "model.switch_every=5", "--set", "train.log_every=5", "--set", "observers.progress=false",
                 "--set", "lr_scheduler.type=\"constant\""])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    changed = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "alpha_changed"]
    assert {c["expert"] for c in changed} == {"high_noise", "low_noise"}, changed
    for expert in ("high_noise", "low_noise"):
        tensors = load_file(str(run_dir / f"quickstart_{expert}.safetensors"))
        assert {float(v) for k, v in tensors.items() if k.endswith(".alpha")} == {7.0}

