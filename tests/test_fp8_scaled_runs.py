"""A whole run with ``model.base_dtype = "fp8_scaled"`` (the quickstart: tiny-t2v, both experts, gradient
checkpointing on, an expert switch every 3 steps) on a CPU: it trains and saves, and a run killed with SIGKILL
after its first checkpoint resumes with ``--resume auto`` to LoRA files byte-equal to an uninterrupted run.

fp8 storage is refused on a CPU only because it is not worth its cost there, so each run allows it
(``FP8_DEVICE_TYPES``) and records that the scaled fp8 conversion ran: the uninterrupted run and the resume in this
process (``tests/inprocess.py``), the run that is killed in a process of its own through a small launcher that does
the same."""

from __future__ import annotations

import os
from pathlib import Path

import prewarmed
import pytest
from inprocess import wantrain
from test_end_to_end import copy_examples

from wantrain.models.wan22 import fp8

pytestmark = pytest.mark.slow

LAUNCHER = """
import os, sys
from wantrain.models.wan22 import adapter, fp8
adapter.FP8_DEVICE_TYPES = ("cuda", "cpu")
convert = fp8.to_scaled_fp8
def to_scaled_fp8(model, *args, **kwargs):
    model = convert(model, *args, **kwargs)
    count = sum(isinstance(m, fp8.ScaledFp8Linear) for m in model.modules())
    with open(os.environ["FP8_MARKER"], "a") as f:
        f.write(f"{next(model.parameters()).device.type}:{count}\\n")
    return model
fp8.to_scaled_fp8 = to_scaled_fp8
from wantrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
SETTINGS = ["train.max_steps=8", "train.log_every=2", "train.save_every=8", "checkpoint.every=4",
            "observers.progress=false", "optimizer.lr=3e-3", "model.gradient_checkpointing=true",
            "model.switch_every=3", 'model.base_dtype="fp8_scaled"']


@pytest.fixture
def converted(monkeypatch) -> list[str]:
    """fp8 allowed on the CPU in this process; each scaled fp8 conversion appends ``"device:ScaledFp8Linears"``
    (device ``meta``: the memory planner's count of the weights)."""
    monkeypatch.setattr("wantrain.models.wan22.adapter.FP8_DEVICE_TYPES", ("cuda", "cpu"))
    conversions, convert = [], fp8.to_scaled_fp8

    def to_scaled_fp8(model, *args, **kwargs):
        model = convert(model, *args, **kwargs)
        count = sum(isinstance(m, fp8.ScaledFp8Linear) for m in model.modules())
        conversions.append(f"{next(model.parameters()).device.type}:{count}")
        return model

    monkeypatch.setattr(fp8, "to_scaled_fp8", to_scaled_fp8)
    return conversions


def run(config: Path, out: Path, *extra: str, resume: bool = False, marker: Path | None = None):
    """A run in this process, or with ``marker`` (where the launcher writes its conversions) in a process of its
    own."""
    args = ["run", str(config), "--set", f"run.output_dir={out}"]
    for item in [*SETTINGS, *extra]:
        args += ["--set", item]
    args += ["--resume", "auto"] if resume else []
    if marker is None:
        return wantrain(*args)
    env = {**os.environ, "FP8_MARKER": str(marker)}
    return prewarmed.run(["-c", LAUNCHER, *args], capture_output=True, text=True, timeout=600, env=env)


def loras(out: Path) -> dict[str, bytes]:
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}


def test_a_scaled_fp8_run_trains_saves_and_resumes_after_sigkill_to_byte_equal_loras(tmp_path, converted):
    config = copy_examples(tmp_path)
    done = run(config, tmp_path / "straight")
    assert done.returncode == 0, done.stderr
    reference = loras(tmp_path / "straight")
    assert set(reference) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    # both experts converted, 10 Linears in each of the tiny twin's 2 blocks
    assert [c for c in converted if not c.startswith("meta:")] == ["cpu:20", "cpu:20"]

    marker = tmp_path / "converted.txt"
    killed = run(config, tmp_path / "killed", "faults.kill_at_steps=[6]", marker=marker)
    assert killed.returncode == -9, killed.stderr
    assert [c for c in marker.read_text().split() if not c.startswith("meta:")] == ["cpu:20", "cpu:20"]
    (run_dir,) = (tmp_path / "killed").iterdir()
    assert (run_dir / "checkpoints" / "step_000004" / "complete.json").exists()
    assert not list(run_dir.glob("quickstart*.safetensors"))
    converted.clear()
    resumed = run(config, tmp_path / "killed", resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert [c for c in converted if not c.startswith("meta:")] == ["cpu:20", "cpu:20"]
    assert loras(tmp_path / "killed") == reference
