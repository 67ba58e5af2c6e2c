"""A whole run with ``model.base_dtype = "fp8_scaled"`` (the quickstart: tiny-t2v, both experts, gradient
checkpointing on, an expert switch every 3 steps) on a CPU: it trains and saves, and a run killed with SIGKILL
after its first checkpoint resumes with ``--resume auto`` to LoRA files byte-equal to an uninterrupted run.

fp8 storage is refused on a CPU only because it is not worth its cost there, so each run goes through a small
launcher that allows it (``FP8_DEVICE_TYPES``) and records that the scaled fp8 conversion ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_end_to_end import copy_examples

pytestmark = pytest.mark.slow

LAUNCHER = """
import os, sys
from wantrain.models.wan22 import adapter, fp8
adapter.FP8_DEVICE_TYPES = ("cuda", "cpu")
convert = fp8.to_scaled_fp8
def to_scaled_fp8(model, *args, **kwargs):
    model = convert(model, *args, **kwargs)
    with open(os.environ["FP8_MARKER"], "a") as f:
        device = next(model.parameters()).device.type  # "meta": the memory planner's count of the weights
        f.write(f"{device}:{sum(isinstance(m, fp8.ScaledFp8Linear) for m in model.modules())}\\n")
    return model
fp8.to_scaled_fp8 = to_scaled_fp8
from wantrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
SETTINGS = ["train.max_steps=8", "train.log_every=2", "train.save_every=8", "checkpoint.every=4",
            "observers.progress=false", "optimizer.lr=3e-3", "model.gradient_checkpointing=true",
            "model.switch_every=3", 'model.base_dtype="fp8_scaled"']


def run(config: Path, out: Path, marker: Path, *extra: str, resume: bool = False) -> subprocess.CompletedProcess:
    args = [sys.executable, "-c", LAUNCHER, "run", str(config), "--set", f"run.output_dir={out}"]
    for item in [*SETTINGS, *extra]:
        args += ["--set", item]
    args += ["--resume", "auto"] if resume else []
    env = {**os.environ, "FP8_MARKER": str(marker)}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def loras(out: Path) -> dict[str, bytes]:
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}


def test_a_scaled_fp8_run_trains_saves_and_resumes_after_sigkill_to_byte_equal_loras(tmp_path):
    config = copy_examples(tmp_path)
    marker = tmp_path / "converted.txt"
    done = run(config, tmp_path / "straight", marker)
    assert done.returncode == 0, done.stderr
    reference = loras(tmp_path / "straight")
    assert set(reference) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    # both experts converted, 10 Linears in each of the tiny twin's 2 blocks
    assert [line for line in marker.read_text().split() if not line.startswith("meta:")] == ["cpu:20", "cpu:20"]

    killed = run(config, tmp_path / "killed", marker, "faults.kill_at_steps=[6]")
    assert killed.returncode == -9, killed.stderr
    (run_dir,) = (tmp_path / "killed").iterdir()
    assert (run_dir / "checkpoints" / "step_000004" / "complete.json").exists()
    assert not list(run_dir.glob("quickstart*.safetensors"))
    resumed = run(config, tmp_path / "killed", marker, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert loras(tmp_path / "killed") == reference
