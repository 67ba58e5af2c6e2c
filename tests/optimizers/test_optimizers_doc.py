"""docs/optimizers.md: its config example loads and builds, and the error line it shows is the one users get."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch

from wantrain.app.config import RunConfig
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError
from wantrain.optimizers import build_optimizer

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text(encoding="utf-8")


def test_the_pages_config_example_builds_a_prodigy_optimizer():
    (block,) = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    cfg = structure(RunConfig, tomllib.loads(block))
    groups = [{"params": [torch.zeros(3, requires_grad=True)], "lr": cfg.optimizer.lr, "name": "lora"}]
    opt = build_optimizer(cfg.optimizer, groups, torch.device("cpu"))
    assert type(opt).__name__ == "ExpertProdigy" and opt.param_groups[0]["weight_decay"] == 0.01


def test_the_pages_error_line_is_the_real_one():
    (shown,) = re.findall(r"```\n(optimizer\.d_cof .*?)\n```", PAGE, flags=re.S)
    with pytest.raises(ConfigError) as info:
        structure(RunConfig, {"optimizer": {"type": "prodigy", "d_cof": 2.0}})
    assert str(info.value) == shown
