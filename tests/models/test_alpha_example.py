"""The seed's I2V alpha-schedule example loads in the seed's spelling and builds on the tiny I2V twin."""

from __future__ import annotations

from pathlib import Path

import torch

from wantrain.app.config import load_config
from wantrain.models.wan22 import build_adapter

ROOT = Path(__file__).resolve().parents[2]


def test_the_seed_i2v_example_loads_in_the_seed_spelling_and_builds_on_the_tiny_twin(tiny_dir):
    example = ROOT / "examples" / "i2v_a14b_alpha_schedule.toml"
    as_written = load_config(example)
    assert as_written.model.variant == "i2v-a14b"
    schedule = as_written.lora.alpha_schedule
    assert [(p.name, p.alpha, p.min_steps) for p in schedule.phases] == [
        ("foundation", 8.0, 2000), ("balance", 14.0, 3000), ("emphasis", 20.0, 2000)]
    assert schedule.phases[0].criterion("min_loss_r2", schedule.preset) == 0.01  # from exit_criteria
    cfg = load_config(example, ["model.variant=tiny-i2v", f"model.path={tiny_dir('tiny-i2v')}"])
    adapter = build_adapter(cfg.model, cfg.lora, seed=0, device=torch.device("cpu"), base_lr=cfg.optimizer.lr)
    assert {adapter.lora_alpha(e) for e in adapter.experts} == {8.0}
