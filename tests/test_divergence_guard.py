"""The divergence guard (train.divergence_factor; core.interval.DivergenceGuard): a run whose loss or LoRA norm
grows past the factor times its early value stops as failed (exit code 1) at a log step, saving nothing more, so
its last checkpoint is the last good one. The tiny Wan model, the demo data, learning rate 1.0 (AdamW: the largest
the config accepts), which grows the LoRA's norm ~10x in two steps and ~16x in four."""

from __future__ import annotations

import json

import pytest
from test_end_to_end import copy_examples

from wantrain.cli.main import main
from wantrain.core.interval import LORA_NORM, LORA_NORM_START, DivergenceGuard

SETTINGS = ["--max-steps", "8", "--set", "optimizer.lr=1.0", "--set", "lr_scheduler.warmup_steps=0",
            "--set", "train.log_every=2", "--set", "checkpoint.every=2", "--set", "observers.progress=false",
            "--set", "observers.record_events=true"]


def test_the_guard_compares_with_the_first_values_and_keeps_them_in_checkpoints():
    guard = DivergenceGuard(10.0)
    assert guard.check({"train/loss": 1.0, LORA_NORM: 30.0, LORA_NORM_START: 5.0}) is None
    assert guard.baseline == {"train/loss": 1.0, LORA_NORM: 5.0}
    assert guard.check({"train/loss": 9.0, LORA_NORM: 49.0, "train/grad_norm": 1e9}) is None
    restored = DivergenceGuard(10.0)
    restored.load_state_dict(guard.state_dict())
    assert "train/loss = 11 is 11x its first logged value 1" in restored.check({"train/loss": 11.0})
    assert "train/lora_norm = 51 is 10x" in restored.check({"train/loss": 1.0, LORA_NORM: 51.0})
    assert DivergenceGuard(None).check({"train/loss": 1e9}) is None  # off


@pytest.mark.slow
def test_a_run_that_diverges_stops_failed_keeping_the_checkpoints_before(tmp_path, capsys):
    config = copy_examples(tmp_path)
    assert main(["run", str(config), *SETTINGS, "--set", "train.divergence_factor=13"]) == 1
    err = capsys.readouterr().err
    assert "the run diverged: train/lora_norm = " in err and "train.divergence_factor = 13" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = logged[0][LORA_NORM_START]
    last = logged[-1]
    assert last[LORA_NORM] > 13 * start and all(r[LORA_NORM] <= 13 * start for r in logged[:-1])
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == [f"step_{s:06d}" for s in range(2, last["step"], 2)]  # nothing saved at the step it tripped
    assert not list(run_dir.glob("*.safetensors"))  # no final LoRA files from a diverged run


@pytest.mark.slow
def test_without_the_guard_the_same_run_completes(tmp_path):
    config = copy_examples(tmp_path)
    assert main(["run", str(config), *SETTINGS]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert LORA_NORM not in logged[-1]  # logged only while the guard is on
