"""Whole runs of the quickstart (tiny-t2v, both experts, LoRA) on low-bit frozen bases (``model.base_dtype =
"int8"`` and ``"nf4"``, models/wan22/lowbit.py) on a CPU, with block swap, activation offload, the lean recompute
and the waiting expert on disk: each trains, a run stopped at step 3 resumes to LoRA files byte-equal to the
uninterrupted run's, and the files load into diffusers' Wan transformer (LoHa and LoKr on these bases:
tests/models/test_low_bit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_resume import workspace  # noqa: F401  (the fixture: the quickstart and its filled cache)

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

STEPS = 6
SETTINGS = ["train.log_every=2", f"train.save_every={STEPS}", "checkpoint.every=3", "observers.progress=false",
            "optimizer.lr=3e-3", "lr_scheduler.type=constant", "model.switch_every=3",
            "model.gradient_checkpointing=true", "model.blocks_to_swap=1", "model.offload_activations=true",
            "model.recompute=lean", "model.waiting_expert=disk", "validation.enabled=false", "sample.enabled=false"]


def _run(root: Path, out: Path, *extra: str, stop_at: int | None = None) -> dict[str, bytes]:
    args = ["run", str(root / "quickstart.toml"), "--set", f"run.output_dir={out}"]
    for item in [*SETTINGS, *extra, f"train.max_steps={stop_at or STEPS}"]:
        args += ["--set", item]
    assert main(args) == 0
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    if stop_at is not None:
        assert main([*args, "--resume", str(run_dir), "--max-steps", str(STEPS)]) == 0
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}


@pytest.mark.parametrize("base_dtype", ["int8", "nf4"])
def test_a_low_bit_run_trains_resumes_bitwise_and_exports_files_diffusers_loads(workspace, tmp_path,  # noqa: F811
                                                                                base_dtype):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders import WanLoraLoaderMixin

    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    extra = (f"model.base_dtype={base_dtype}",)
    straight = _run(workspace, tmp_path / "straight", *extra)
    assert set(straight) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    assert _run(workspace, tmp_path / "resumed", *extra, stop_at=3) == straight
    transformer = WanTransformer3DModel(**transformer_kwargs(VARIANTS["tiny-t2v"]))
    (run_dir,) = [d for d in (tmp_path / "straight").iterdir() if d.is_dir()]
    state = WanLoraLoaderMixin.lora_state_dict(str(run_dir / "quickstart_low_noise.safetensors"))
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=transformer, adapter_name="trained")
    adapted = [n for n, p in transformer.named_parameters() if ".trained" in n and p.abs().sum() > 0]
    assert len(adapted) >= 20 and all(torch.isfinite(p).all() for p in transformer.parameters())
