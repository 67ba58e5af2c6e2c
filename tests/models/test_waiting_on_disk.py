"""The waiting expert on disk (``model.waiting_expert = "disk"``, models/wan22/waiting.py): the expert that is not
training holds no frozen tensor in host memory, its file is written once, and the host plan counts what it saves
and what each switch reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.wan22_helpers import raw_batch, train_steps
from wantrain.core.errors import ConfigError
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
from wantrain.models.wan22.memory import MemorySettings, host_estimate


def _adapter(mode: str, folder, swap: int = 1):
    model = ModelConfig(variant="tiny-t2v", switch_every=1, waiting_expert=mode, blocks_to_swap=swap)
    return build_adapter(model, LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=1e-3,
                         waiting_folder=folder)


def _frozen_host_bytes(adapter) -> int:
    """Bytes of the distinct host storages behind every frozen tensor the adapter holds: the transformers' own
    (on a CPU run the training device is the host) and the block swaps' host copies."""
    storages: dict[int, int] = {}
    for expert in adapter.experts:
        transformer, swap = adapter.transformer_for(expert), adapter.swap_for(expert)
        tensors = [t for t in [*transformer.parameters(), *transformer.buffers()] if not t.requires_grad]
        tensors += [h for rows in (swap._host.values() if swap else ()) for *_, h in rows]
        for tensor in tensors:
            if tensor.device.type == "cpu":
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def test_the_waiting_expert_on_disk_frees_one_experts_frozen_bytes_as_the_host_plan_counts(tmp_path):
    held = {}
    for mode in ("resident", "disk"):
        adapter = _adapter(mode, tmp_path / mode)
        train_steps(adapter, adapter.encode_batch(raw_batch()), steps=3)  # high, low, high: two switches
        held[mode] = _frozen_host_bytes(adapter)
        if mode == "disk":
            low = adapter.transformer_for("low_noise")
            assert {p.device.type for p in low.parameters() if not p.requires_grad} == {"meta"}
            assert {h.device.type for rows in adapter.swap_for("low_noise")._host.values() for *_, h in rows} == \
                {"meta"}
            assert all(p.device.type == "cpu" for p in adapter.trainable_parameters("low_noise"))  # LoRA stays
    plans = {mode: host_estimate("tiny-t2v", MemorySettings("fp32", 1), experts=("high_noise", "low_noise"), rank=4,
                                 width=32, height=32, frames=9, cuda=False, encoders=False, waiting=mode)
             for mode in ("resident", "disk")}
    expert = plans["resident"].parts["low-noise expert host copy (fp32)"]
    assert held["resident"] - held["disk"] == expert > 0  # one whole expert, exactly as the plan counts it
    assert sum(plans["resident"].parts.values()) - sum(plans["disk"].parts.values()) == pytest.approx(
        2 * expert - plans["disk"].parts["training expert's swap copy (fp32)"])
    read = plans["disk"].switch_read
    assert read.bytes == expert and read.seconds_per_step == pytest.approx(expert / 2e9 / 10)


def test_the_waiting_file_is_written_once_and_read_by_the_next_build(tmp_path):
    first = _adapter("disk", tmp_path)
    assert sorted(p.name.split("-")[0] for p in first.waiting.written) == ["high_noise", "low_noise"]
    files = {p: p.stat().st_mtime_ns for p in first.waiting.written}
    second = _adapter("disk", tmp_path)
    assert second.waiting.written == [] and {p: p.stat().st_mtime_ns for p in files} == files
    assert not list(tmp_path.glob("*.partial"))


def test_disk_applies_to_two_trained_experts_only():
    with pytest.raises(ConfigError, match="waiting_expert = 'disk' applies to a run that trains both"):
        ModelConfig(variant="tiny-t2v", experts="high_noise", waiting_expert="disk")
    with pytest.raises(ConfigError, match="expert_groups = 2"):
        ModelConfig(variant="tiny-t2v", expert_groups=2, waiting_expert="disk")


def test_check_fits_both_a14b_experts_in_32_gb_with_the_waiting_expert_on_disk_as_the_docs_say(tmp_path, capsys,
                                                                                                monkeypatch):
    from tests.models.test_memory_plan import a14b_config
    from wantrain.cli.main import main

    monkeypatch.setattr("wantrain.app.preflight.check_model_files", lambda model, **_: None)  # no A14B weights here
    monkeypatch.setattr("wantrain.app.preflight.missing_model_files", lambda model: [])
    docs = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    section = docs.split("#### The waiting expert on disk")[1]
    printed = section.split("check's lines):\n\n```\n")[1].split("```")[0]
    config = a14b_config(tmp_path, 15)
    config.write_text(config.read_text().replace("vram_budget_gb = 15", "vram_budget_gb = 15\nhost_ram_budget_gb = 32")
                      + "\n[lora]\nrank = 32\n")
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out.split("host memory (RAM), part by part (docs/models.md, Host memory):\n")[1]
    assert out.startswith(printed)
    assert 'waiting_expert = "disk"' in printed and "low-noise expert host copy" not in printed


def test_the_waiting_experts_adapter_state_is_its_lora_and_adamw_moments_as_the_host_plan_counts(tmp_path):
    """Between steps no expert has gradients (the loop sets them to None after each step), so the expert that waits
    holds its LoRA and AdamW's two moments: 12 bytes per parameter, not 16."""
    from wantrain.models.wan22.memory import WAITING_LORA_PART

    adapter = _adapter("resident", tmp_path, swap=0)
    optimizer = train_steps(adapter, adapter.encode_batch(raw_batch()), steps=2)  # high, low: high waits
    waiting = adapter.trainable_parameters("high_noise")
    assert waiting and all(p.grad is None and p.device.type == "cpu" for p in waiting)
    held = sum(t.numel() * t.element_size() for p in waiting
               for t in [p, *(v for k, v in optimizer.state[p].items() if k != "step")])  # step: one number
    plan = host_estimate("tiny-t2v", MemorySettings("fp32", 0), experts=("high_noise", "low_noise"), rank=4,
                         width=32, height=32, frames=9, cuda=False, encoders=False)
    assert held == plan.parts[WAITING_LORA_PART] > 0


def test_the_steps_per_hour_the_reads_cost_come_from_a_step_flop_count_at_most_the_traced_one():
    """``check``'s waiting line states what the reads cost in steps per hour from the step's FLOPs
    (``memory.step_flops``): counted from the blocks, at most the fake-tensor trace's count (which adds the LoRA and
    the embeddings) and within 10 % of it, so the share of steps the reads cost is never understated."""
    from tests.models.test_memory_plan import trace_module
    from wantrain.models.wan22.memory import step_flops

    traced = trace_module().trace("t2v-a14b", "bf16", 0, True, (832, 480, 81), 32, layers=2, count_flops=True)
    counted = step_flops("t2v-a14b", width=832, height=480, frames=81, layers=2)
    assert 0.9 * traced["tflops"] * 1e12 <= counted <= traced["tflops"] * 1e12
    plan = host_estimate("t2v-a14b", MemorySettings("fp8", 33, True, "lean"), experts=("high_noise", "low_noise"),
                         rank=32, width=832, height=480, frames=81, waiting="disk", switch_every=50)
    read = plan.switch_read
    step = read.reference_step_seconds
    assert step == pytest.approx(step_flops("t2v-a14b", width=832, height=480, frames=81, recompute="lean") / 395.6e12)
    assert read.fewer_steps_per_hour(step) < 0.05  # the target: <= 5 % at switch_every >= 50, 2 GB/s
    assert f"{100 * read.fewer_steps_per_hour(step):.1f} % fewer steps per hour" in read.line()
