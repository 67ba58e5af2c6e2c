"""Every TOML example in docs/models.md is a valid run config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wantrain.app.config import load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
SNIPPETS = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_models_page_has_config_examples():
    assert len(SNIPPETS) >= 7  # includes the model files, init_from and LoRA+ examples


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_models_page_config_example_loads(index, tmp_path):
    file = tmp_path / "example.toml"
    file.write_text(SNIPPETS[index])
    cfg = load_config(file)
    assert cfg.model.variant and (cfg.lora.rank >= 1 if cfg.lora.rank is not None else cfg.lora.starts_from_files)
