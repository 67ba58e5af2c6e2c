"""Issue 56's runs of the quickstart (tiny-t2v, both experts) on a CPU, with block swap, activation offload and
the lean recompute (one module: they share the filled cache):

* the waiting expert on disk: the LoRA files and the logged metrics are byte-equal to the run with the waiting
  expert resident, through expert switches, validation, a sample round and a resume;
* quantised frozen bases (``model.base_dtype = "int8"`` and ``"nf4"``, models/wan22/lowbit.py; ``"fp8"`` and
  ``"fp8_scaled"``) with the waiting expert on disk, each adapter type on each: each trains, a run stopped at step 2
  resumes to files byte-equal to the uninterrupted run's, and the LoRA and DoRA files load into diffusers' Wan
  transformer (diffusers has no loader for LoKr or LoHa on Wan: docs/models.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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
    before = set(workspace.rglob("waiting_experts/*.safetensors"))  # the low-bit runs' files, if they ran first
    resident = _run(workspace, tmp_path / "resident", "resident")
    disk = _run(workspace, tmp_path / "disk", "disk")
    assert _loras(disk) == _loras(resident)
    assert _metrics(disk) == _metrics(resident) and any("loss" in key for row in _metrics(resident) for key in row)
    cache_files = set(workspace.rglob("waiting_experts/*.safetensors")) - before
    assert sorted(p.name.split("-")[0] for p in cache_files) == ["high_noise", "low_noise"]
    resumed = _run(workspace, tmp_path / "resumed", "disk", stop_at=4)  # a switch at 3 and 6: one on each side
    assert _loras(resumed) == _loras(resident)
    assert set(workspace.rglob("waiting_experts/*.safetensors")) - before == cache_files  # written once, read since


LOW_BIT_STEPS = 4
LOW_BIT_SETTINGS = ["train.log_every=2", f"train.save_every={LOW_BIT_STEPS}", "checkpoint.every=2",
                    "observers.progress=false", "optimizer.lr=3e-3", "lr_scheduler.type=constant",
                    "model.switch_every=2", "model.gradient_checkpointing=true", "model.blocks_to_swap=1",
                    "model.offload_activations=true", "model.recompute=lean", "model.waiting_expert=disk",
                    "validation.enabled=false", "sample.enabled=false"]


def _low_bit_run(root: Path, out: Path, *extra: str, stop_at: int | None = None) -> dict[str, bytes]:
    args = ["run", str(root / "quickstart.toml"), "--set", f"run.output_dir={out}"]
    for item in [*LOW_BIT_SETTINGS, *extra, f"train.max_steps={stop_at or LOW_BIT_STEPS}"]:
        args += ["--set", item]
    assert main(args) == 0
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    if stop_at is not None:
        assert main([*args, "--resume", str(run_dir), "--max-steps", str(LOW_BIT_STEPS)]) == 0
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}


def _diffusers_state(path: Path, transformer) -> dict[str, torch.Tensor]:
    """The file at ``path`` as ``WanLoraLoaderMixin.load_lora_into_transformer`` takes it. A DoRA file: diffusers
    (0.42) has no Wan conversion for ``dora_scale`` (docs/models.md, Adapter types), so its LoRA keys go through
    diffusers' conversion and each ``dora_scale`` becomes peft's ``lora_magnitude_vector`` against ``transformer``'s
    own base rows, ``m = dora_scale * ||W + B A|| / (||W|| + eps)`` (ComfyUI's weight, the file's meaning)."""
    from diffusers.loaders import WanLoraLoaderMixin
    from safetensors.torch import load_file, save_file

    from wantrain.models.wan22.adapter_types import DIFFUSERS_TO_WAN, F32_EPS

    tensors = load_file(str(path))
    scales = {k: v for k, v in tensors.items() if k.endswith(".dora_scale")}
    if scales:
        path = path.with_suffix(".lora_keys.safetensors")
        save_file({k: v for k, v in tensors.items() if k not in scales}, str(path))
    state = WanLoraLoaderMixin.lora_state_dict(str(path))
    layers, to_diffusers = dict(transformer.named_modules()), {w: d for d, w in DIFFUSERS_TO_WAN.items()}
    for key, scale in scales.items():
        block, group, leaf, _ = key.partition(".blocks.")[2].split(".", 3)
        name = f"blocks.{block}.{to_diffusers[f'{group}.{leaf}']}"
        weight = layers[name].weight.detach().float()  # diffusers' conversion folds alpha / rank into the factors
        adapted = weight + state[f"transformer.{name}.lora_B.weight"].float() @ state[
            f"transformer.{name}.lora_A.weight"].float()
        state[f"transformer.{name}.lora_magnitude_vector"] = (scale.float().view(-1) * adapted.norm(dim=1) /
                                                              (weight.norm(dim=1) + F32_EPS))
    return state


# each adapter type on each quantised base (fp8 storage is refused on a CPU for its cost only: allowed here, as in
# tests/test_fp8_scaled_runs.py); LoKr and LoHa files have no loader in diffusers (docs/models.md)
@pytest.mark.parametrize("base_dtype, kind", [("int8", "lora"), ("nf4", "lora"), ("int8", "dora"), ("nf4", "dora"),
                                              ("int8", "lokr"), ("nf4", "loha"), ("fp8", "lora"),
                                              ("fp8_scaled", "dora"), ("fp8", "loha"), ("fp8_scaled", "lokr")])
def test_a_quantised_run_trains_resumes_bitwise_and_exports_its_files(workspace, tmp_path, monkeypatch,  # noqa: F811
                                                                      base_dtype, kind):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders import WanLoraLoaderMixin

    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    monkeypatch.setattr("wantrain.models.wan22.adapter.FP8_DEVICE_TYPES", ("cuda", "cpu"))
    extra = (f"model.base_dtype={base_dtype}", f"lora.type={kind}")
    straight = _low_bit_run(workspace, tmp_path / "straight", *extra)
    assert set(straight) == {"quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"}
    assert _low_bit_run(workspace, tmp_path / "resumed", *extra, stop_at=2) == straight  # a switch after the resume
    if kind == "dora":  # its export reads the base rows: the waiting expert's, lent block by block from its file
        assert _low_bit_run(workspace, tmp_path / "resident", *extra, "model.waiting_expert=resident") == straight
    if kind in ("lokr", "loha"):  # ComfyUI's keys for the type (lokr_w1, hada_w1_a, ...), trained and finite
        from safetensors.torch import load

        files = [load(data) for data in straight.values()]
        key = {"lokr": ".lokr_w1", "loha": ".hada_w1_a"}[kind]
        assert all(sum(k.endswith(key) for k in f) >= 20 and all(torch.isfinite(v).all() for v in f.values())
                   for f in files)
        assert files[0].keys() == files[1].keys() and any(not torch.equal(files[0][k], files[1][k]) for k in files[0])
        return
    transformer = WanTransformer3DModel(**transformer_kwargs(VARIANTS["tiny-t2v"]))
    (run_dir,) = [d for d in (tmp_path / "straight").iterdir() if d.is_dir()]
    state = _diffusers_state(run_dir / "quickstart_low_noise.safetensors", transformer)
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=transformer, adapter_name="trained")
    adapted = [n for n, p in transformer.named_parameters() if ".trained" in n and p.abs().sum() > 0]
    assert len(adapted) >= 20 and all(torch.isfinite(p).all() for p in transformer.parameters())
    magnitudes = [n for n in adapted if "lora_magnitude_vector" in n]
    assert len(magnitudes) == (20 if kind == "dora" else 0)
