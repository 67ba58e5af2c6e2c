"""Export: file names per expert, Wan key names, live alpha, metadata; and ``wantrain inspect-lora``."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from wan22_helpers import make_adapter

import wantrain
from wantrain.cli import inspect_lora
from wantrain.core.errors import UserError
from wantrain.models.wan22.export import WAN_KEY


def test_one_file_per_expert_with_step_names_until_the_final_save(tmp_path):
    saver = make_adapter("tiny-t2v").saver(tmp_path, "hero")
    written = saver.save(step=50, final=False) + saver.save(step=100, final=True)
    assert [p.rsplit("/", 1)[1] for p in written] == [
        "hero_step000050_high_noise.safetensors", "hero_step000050_low_noise.safetensors",
        "hero_high_noise.safetensors", "hero_low_noise.safetensors",
    ]
    single = make_adapter("tiny-ti2v").saver(tmp_path, "hero").save(step=7, final=False)
    assert single[0].endswith("hero_step000007.safetensors")
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temp files


def test_exported_keys_are_wan_names_with_the_alpha_in_force_and_metadata(tmp_path):
    adapter = make_adapter("tiny-t2v", rank=4, alpha=2.0, experts="low_noise")
    adapter.set_lora_alpha(3.0)  # what a progressive alpha controller does mid-run
    (path,) = adapter.saver(tmp_path, "x").save(step=12, final=True)
    tensors = load_file(path)
    assert all(WAN_KEY.match(k) for k in tensors)
    assert not any("k_img" in k or "v_img" in k for k in tensors)
    modules = {k.rsplit(".", 2)[0] for k in tensors if k.endswith("lora_A.weight")}
    assert len(modules) == 2 * 10
    assert "diffusion_model.blocks.1.cross_attn.o" in modules and "diffusion_model.blocks.0.ffn.2" in modules
    assert tensors["diffusion_model.blocks.0.self_attn.q.lora_A.weight"].shape == (4, 24)
    assert tensors["diffusion_model.blocks.0.ffn.0.lora_B.weight"].shape == (32, 4)
    alphas = {float(v) for k, v in tensors.items() if k.endswith(".alpha")}
    assert alphas == {3.0} and tensors["diffusion_model.blocks.0.ffn.0.alpha"].dim() == 0
    with safe_open(path, framework="pt") as handle:
        meta = handle.metadata()
    assert meta["variant"] == "tiny-t2v" and meta["expert"] == "low_noise" and meta["step"] == "12"
    assert meta["rank"] == "4" and meta["alpha"] == "3" and meta["wantrain_version"] == wantrain.__version__


def test_lora_alpha_defaults_to_rank():
    assert make_adapter("tiny-ti2v", rank=6).lora_alpha(None) == 6.0


def _run_inspect(path) -> int:
    parser = argparse.ArgumentParser()
    inspect_lora.add_arguments(parser)
    return inspect_lora.run(parser.parse_args([str(path)]))


def test_inspect_lora_prints_variant_expert_rank_and_alpha(tmp_path, capsys):
    adapter = make_adapter("tiny-i2v", rank=4, alpha=8.0, experts="high_noise")
    (path,) = adapter.saver(tmp_path, "hero").save(step=30, final=True)
    assert _run_inspect(path) == 0
    out = capsys.readouterr().out
    for line in ("variant: tiny-i2v", "expert: high_noise", "step: 30", "self_attn: rank 4, alpha 8",
                 "cross_attn: rank 4, alpha 8", "ffn: rank 4, alpha 8", "keys: all valid"):
        assert line in out


def test_inspect_lora_fails_on_the_first_bad_key_naming_it(tmp_path):
    adapter = make_adapter("tiny-t2v", experts="high_noise")
    (path,) = adapter.saver(tmp_path, "hero").save(step=1, final=True)
    tensors = load_file(path)
    tensors["diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight"] = torch.zeros(4, 24)  # a Wan 2.1 key
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata={"variant": "tiny-t2v"})
    with pytest.raises(UserError, match=r"key 'diffusion_model\.blocks\.0\.cross_attn\.k_img\.lora_A\.weight'"):
        _run_inspect(bad)
    tensors.pop("diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight")
    tensors["diffusion_model.blocks.5.ffn.0.lora_A.weight"] = torch.zeros(4, 24)  # the tiny model has 2 blocks
    save_file(tensors, str(bad), metadata={"variant": "tiny-t2v"})
    with pytest.raises(UserError, match="names block 5, but tiny-t2v has blocks 0..1"):
        _run_inspect(bad)


def test_inspect_lora_rejects_missing_and_non_safetensors_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        _run_inspect(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(UserError, match="not a readable safetensors file") as err:
        _run_inspect(junk)
    assert "\n" not in str(err.value)
