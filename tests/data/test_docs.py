"""Every TOML example in docs/data.md is a valid config."""

import re
import tomllib
from pathlib import Path

from wantrain.app.config import RunConfig
from wantrain.core.config import structure

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def test_every_toml_example_in_the_data_docs_is_valid_config():
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 8  # includes the captions, metadata and epochs examples
    for block in blocks:
        cfg = structure(RunConfig, tomllib.loads(block))
        assert cfg.data.dataset_list()
