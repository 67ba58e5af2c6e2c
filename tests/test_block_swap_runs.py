"""Block swap and activation offload in whole runs of the quickstart (tiny-t2v, both experts, an expert switch
every 10 steps) on a CPU: the LoRA files are byte-equal to the same run without them, through the out-of-memory
guard (faults injected in the backward pass, while swapped blocks are loaded), its emergency checkpoint and a
resume with the swap on."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_resume import workspace  # noqa: F401  (the fixture: the quickstart and its filled cache)

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

SETTINGS = ["train.max_steps=24", "train.log_every=4", "train.save_every=24", "checkpoint.every=8",
            "observers.progress=false", "optimizer.lr=3e-3", "model.gradient_checkpointing=true",
            "faults.oom_at_steps=[13, 14, 15]", "faults.oom_phase=backward", "train.max_consecutive_oom=3"]


def run_then_resume(root: Path, out: Path, *extra: str) -> dict[str, bytes]:
    """Run until the guard gives up at step 15 (exit 1, emergency checkpoint), resume to step 24 (exit 0)."""
    args = ["run", str(root / "quickstart.toml"), "--set", f"run.output_dir={out}"]
    for item in [*SETTINGS, *extra]:
        args += ["--set", item]
    assert main(args) == 1
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    assert (run_dir / "checkpoints" / "step_000015" / "complete.json").exists()
    assert main([*args, "--resume", "auto"]) == 0
    files = {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}
    assert set(files) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    return files


def test_swap_and_offload_give_byte_equal_loras_through_the_oom_guard_a_switch_and_a_resume(workspace,  # noqa: F811
                                                                                            tmp_path):
    reference = run_then_resume(workspace, tmp_path / "plain")
    swapped = run_then_resume(workspace, tmp_path / "swapped", "model.blocks_to_swap=1",
                              "model.offload_activations=true")
    assert swapped == reference
