"""Samples with the user's LoRA files stacked under the trained one (``[sample] loras``, wan22/stacked.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.models.wan22_helpers import make_adapter
from wantrain.core.errors import ConfigError
from wantrain.models.wan22.lora_files import WAN_TO_DIFFUSERS
from wantrain.models.wan22.stacked import merge_into, read_stacked
from wantrain.models.wan22.variants import VARIANTS
from wantrain.observers.evaluation import samples as samples_module
from wantrain.observers.evaluation.config import SampleConfig, SamplePrompt, StackedLora, check_sections
from wantrain.observers.evaluation.samples import SampleJob, SampleVideos


def distillation_lora(path: Path, transformer: torch.nn.Module, *, rank: int = 4, extra_block: bool = True) -> Path:
    """A LoRA in the lightx2v / kijai layout (original Wan names, ``lora_down`` / ``lora_up``, ``alpha``, ``diff_b``
    biases) for every block of ``transformer``, plus (``extra_block``) one block it does not have."""
    g = torch.Generator().manual_seed(3)
    named = dict(transformer.named_modules())
    blocks = len(transformer.blocks) + (1 if extra_block else 0)
    tensors = {}
    for b in range(blocks):
        for wan, diffusers in WAN_TO_DIFFUSERS.items():
            base = named[f"blocks.0.{diffusers}"]
            base = getattr(base, "base_layer", base)
            key = f"diffusion_model.blocks.{b}.{wan}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, base.in_features, generator=g) * 0.3
            tensors[f"{key}.lora_up.weight"] = torch.randn(base.out_features, rank, generator=g) * 0.3
            tensors[f"{key}.alpha"] = torch.tensor(2.0)
            tensors[f"{key}.diff_b"] = torch.randn(base.out_features, generator=g) * 0.05
    save_file(tensors, str(path))
    return path


def sample_latents(adapter, tmp_path: Path, monkeypatch, loras: tuple = ()) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    original = samples_module.latents_image
    monkeypatch.setattr(samples_module, "latents_image", lambda latents, h: seen.append(latents.clone()) or
                        original(latents, h))
    text = adapter.encode_text(["a red ball"])["text_embeds"]
    job = SampleJob(index=0, prompt_embeds=text, negative_embeds=None, width=32, height=32, frames=5, seed=1,
                    steps=4, guidance_scale=1.0, guidance_scale_high_noise=1.0, loras=loras)
    SampleVideos(out_dir=tmp_path, jobs=[job], every=1, fps=16).sample(len(seen), adapter)
    return seen[-1]


def test_a_stacked_lora_changes_the_sample_equals_the_merged_model_and_leaves_nothing_behind(tmp_path, monkeypatch):
    adapter = make_adapter("tiny-t2v", gradient_checkpointing=False)
    path = distillation_lora(tmp_path / "lightx2v_style.safetensors", adapter.transformer_for("high_noise"))
    stacked = (StackedLora(path=path, strength=0.7),)
    trained_before = {k: v.detach().clone() for k, v in adapter.state_dict()["weights"].items()}
    exported_before = adapter.adapter_tensors("high_noise", torch.float32)

    plain = sample_latents(adapter, tmp_path, monkeypatch)
    with_lora = sample_latents(adapter, tmp_path, monkeypatch, stacked)
    assert (with_lora - plain).abs().max() > 0.1  # the stacked LoRA acts
    again = sample_latents(adapter, tmp_path, monkeypatch)
    assert torch.equal(again, plain)  # and is gone after: the run's own sample stays what it was

    # never trained, checkpointed or exported; no hook left on any module
    assert adapter.state_dict()["weights"].keys() == trained_before.keys()
    assert all(torch.equal(v, trained_before[k]) for k, v in adapter.state_dict()["weights"].items())
    assert adapter.adapter_tensors("high_noise", torch.float32).keys() == exported_before.keys()
    assert not any(m._forward_hooks for e in adapter.experts for m in adapter.transformer_for(e).modules())

    modules, _ = read_stacked(path, "sample.loras")
    for expert in adapter.experts:
        merge_into(adapter.transformer_for(expert), modules, 0.7)
    merged = sample_latents(adapter, tmp_path, monkeypatch)
    assert torch.allclose(merged, with_lora, atol=1e-4, rtol=1e-4), (merged - with_lora).abs().max()


def test_keys_that_match_no_module_are_named_in_one_line_and_an_expert_only_lora_touches_only_that_expert(tmp_path):
    adapter = make_adapter("tiny-t2v", gradient_checkpointing=False)
    blocks = len(adapter.transformer_for("high_noise").blocks)
    path = distillation_lora(tmp_path / "distill.safetensors", adapter.transformer_for("high_noise"))
    (line,) = adapter.check_stacked_loras([StackedLora(path=path)])
    assert "\n" not in line and "10 of its modules match nothing" in line and f"blocks.{blocks}." in line
    low_only = StackedLora(path=distillation_lora(tmp_path / "fits.safetensors", adapter.transformer_for("low_noise"),
                                                  extra_block=False), expert="low_noise")
    assert adapter.check_stacked_loras([low_only]) == []
    with adapter.stacked_loras([low_only]):
        hooked = {e: sum(bool(m._forward_hooks) for m in adapter.transformer_for(e).modules()) for e in adapter.experts}
    assert hooked == {"high_noise": 0, "low_noise": 10 * blocks}


def test_a_prompts_own_loras_replace_the_sections_and_a_missing_file_is_refused_in_one_line(tmp_path):
    spec = VARIANTS["tiny-t2v"]
    lora = tmp_path / "distill.safetensors"
    lora.write_bytes(b"")
    section = SampleConfig(enabled=True, loras=[StackedLora(path=lora, strength=0.5)],
                           prompts=["plain is the section's", SamplePrompt(prompt="own", loras=[]),
                                    SamplePrompt(prompt="fast", steps=4, guidance_scale=1.0,
                                                 loras=[StackedLora(path=lora, expert="low_noise")])])
    first, own, fast = section.resolved(spec)
    assert [len(p.loras) for p in (first, own, fast)] == [1, 0, 1] and fast.loras[0].expert == "low_noise"
    check_sections(attrs_validation(), section, spec, ("high_noise", "low_noise"))
    missing = SampleConfig(enabled=True, prompts=[SamplePrompt(prompt="x", loras=[StackedLora(path=tmp_path / "no")])])
    with pytest.raises(ConfigError, match=r"'sample.prompts\[0\].loras\[0\].path' = .* does not exist"):
        check_sections(attrs_validation(), missing, spec, ("high_noise", "low_noise"))


def attrs_validation():
    from wantrain.observers.evaluation.config import ValidationConfig

    return ValidationConfig()


def test_the_docs_example_gives_one_prompt_alone_and_one_with_both_experts_speed_up_loras(tmp_path):
    import re

    from wantrain.app.config import load_config

    text = (Path(__file__).resolve().parents[2] / "docs" / "validation.md").read_text(encoding="utf-8")
    example = re.search(r"## Samples with your other LoRAs stacked.*?```toml\n(.*?)```", text, re.S).group(1)
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "data"\n' + example, encoding="utf-8")
    alone, fast = load_config(config).sample.resolved(VARIANTS["tiny-t2v"])
    assert alone.loras == () and (fast.steps, fast.guidance_scale) == (4, 1.0)
    assert [(lora.expert, lora.strength) for lora in fast.loras] == [("high_noise", 1.0), ("low_noise", 1.0)]
