"""The example configs for real runs load, and build an adapter once pointed at a tiny twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wantrain.app.config import load_config
from wantrain.models.wan22 import build_adapter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TWINS = {"t2v_a14b.toml": ("t2v-a14b", "tiny-t2v"), "i2v_a14b.toml": ("i2v-a14b", "tiny-i2v"),
         "ti2v_5b.toml": ("ti2v-5b", "tiny-ti2v"), "vace_a14b.toml": ("vace-t2v-a14b", "tiny-vace-t2v")}


@pytest.mark.parametrize("name", list(TWINS))
def test_example_config_is_valid_and_builds_on_its_tiny_twin(name, tiny_dir):
    real, tiny = TWINS[name]
    as_written = load_config(EXAMPLES / name)
    assert as_written.model.variant == real and as_written.model.path is not None
    cfg = load_config(EXAMPLES / name, [f"model.variant={tiny}", f"model.path={tiny_dir(tiny)}"])
    adapter = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=torch.device("cpu"),
                            base_lr=cfg.optimizer.lr)
    assert adapter.experts == as_written.model.trained_experts
    assert [g["name"] for g in adapter.param_groups()] == [
        {"high_noise": "high_noise", "low_noise": "low_noise", None: "lora"}[e] for e in adapter.experts
    ]
    assert adapter.lora_alpha(adapter.experts[0]) == cfg.lora.effective_alpha
