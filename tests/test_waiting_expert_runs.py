"""The waiting expert on disk in whole runs of the quickstart (tiny-t2v, both experts) on a CPU, with block swap,
activation offload and the lean recompute: the LoRA files and the logged metrics are byte-equal to the run with
the waiting expert resident, through expert switches, validation, a sample round and a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_resume import workspace  # noqa: F401  (the fixture: the quickstart and its filled cache)

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

STEPS = 8
SETTINGS = ["train.log_every=2", f"train.save_every={STEPS}", "checkpoint.every=4", "observers.progress=false",
            "optimizer.lr=3e-3", "lr_scheduler.type=constant", "model.switch_every=3",
            "model.gradient_checkpointing=true", "model.blocks_to_swap=1", "model.offload_activations=true",
            "model.recompute=lean", "validation.every=4", f"sample.every={STEPS}"]
TIMING = ("time", "per_s", "s_per", "sec", "elapsed", "memory", "rss", "eta")


def _run(root: Path, out: Path, waiting: str, *, stop_at: int | None = None) -> Path:
    args = ["run", str(root / "quickstart.toml"), "--set", f"run.output_dir={out}", "--set",
            f"model.waiting_expert={waiting!r}"]
    for item in [*SETTINGS, f"train.max_steps={stop_at or STEPS}"]:
        args += ["--set", item]
    assert main(args) == 0
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    if stop_at is not None:  # resume the run that ended at stop_at and train it on to the last step
        assert main([*args, "--resume", str(run_dir), "--max-steps", str(STEPS)]) == 0
    return run_dir


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in rows]


def _loras(run_dir: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}
    assert set(files) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    return files


def test_the_waiting_expert_on_disk_trains_resumes_and_samples_bitwise_as_the_resident_one(workspace,  # noqa: F811
                                                                                            tmp_path):
    resident = _run(workspace, tmp_path / "resident", "resident")
    disk = _run(workspace, tmp_path / "disk", "disk")
    assert _loras(disk) == _loras(resident)
    assert _metrics(disk) == _metrics(resident) and any("loss" in key for row in _metrics(resident) for key in row)
    cache_files = list(workspace.rglob("waiting_experts/*.safetensors"))
    assert sorted(p.name.split("-")[0] for p in cache_files) == ["high_noise", "low_noise"]
    resumed = _run(workspace, tmp_path / "resumed", "disk", stop_at=4)  # a switch at 3 and 6: one on each side
    assert _loras(resumed) == _loras(resident)
    assert list(workspace.rglob("waiting_experts/*.safetensors")) == cache_files  # written once, read since
