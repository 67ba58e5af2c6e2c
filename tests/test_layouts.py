"""The several-GPU layouts' config-only refusals (``wantrain.app.layouts.problems``, issue #57's broken pairs):
``wantrain check`` and ``wantrain run`` refuse each pair in one line, exit 2, before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from wantrain.app.config import load_config
from wantrain.cli.main import main
from wantrain.core.config import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICKSTART = EXAMPLES / "quickstart.toml"
FSDP = ['model.parallel="fsdp"', 'model.experts="high_noise"', "sample.enabled=false", "validation.enabled=false"]

PAIRS = [
    (QUICKSTART, ['optimizer.type="adamw8bit"'],
     "optimizer.type = 'adamw8bit' does not run with model.parallel = 'fsdp' (bitsandbytes' 8-bit AdamW"),
    (QUICKSTART, ['optimizer.type="adafactor"'],
     "optimizer.type = 'adafactor' does not run with model.parallel = 'fsdp' (transformers' Adafactor"),
]


@pytest.mark.parametrize(("config", "overrides", "words"), PAIRS)
def test_a_pair_fsdp_cannot_run_is_refused_in_one_line_when_the_config_is_read(config, overrides, words):
    with pytest.raises(ConfigError) as refused:
        load_config(config, [*FSDP, *overrides])
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    load_config(config, ['model.parallel="dp"', *FSDP[1:], *overrides])  # the same pair without fsdp: accepted


def test_check_refuses_the_pair_before_anything_loads(tmp_path, capsys):
    args = [a for item in [*FSDP, 'optimizer.type="adafactor"'] for a in ("--set", item)]
    assert main(["check", str(QUICKSTART), *args, "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("wantrain check: error: ") and "\n" not in err and "adafactor" in err, err
