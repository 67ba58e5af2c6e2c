"""The first hour, round 4 (issue 49), what was left: a peer's value for a wantrain key, a musubi-tuner prompt file,
the quickstart's pictures showing what the LoRA learned, a first line before the heavy imports, and console lines
with relative paths and readable numbers."""

from __future__ import annotations

import pytest

from tests.test_day_one_runs import workspace
from wantrain.cli.main import main

SHIFT_LINE = ('timestep_sampling = "shift" is musubi-tuner\'s; in wantrain it is model.timestep_sampling = "sigmoid", '
              "with model.sigmoid_scale = its sigmoid_scale (default 1.0) and model.shift = musubi-tuner's "
              "discrete_flow_shift")


@pytest.mark.parametrize("table", ["", "[train]\n", "[model]\n"])
def test_musubi_timestep_sampling_shift_is_named_as_sigmoid_with_model_shift_wherever_it_is_written(
        tmp_path, capsys, table):
    config = workspace(tmp_path)
    text = config.read_text()
    if table:
        assert table in text
        text = text.replace(table, f'{table}timestep_sampling = "shift"\n', 1)
    else:
        text = f'timestep_sampling = "shift"\n{text}'
    config.write_text(text)
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert SHIFT_LINE in err and "Traceback" not in err, err
    assert "belongs at" not in err  # not sent to model.timestep_sampling with a value it refuses
    assert main(["check", str(config), "--timestep_sampling", "shift"]) == 2  # musubi's command-line habit
    assert '--timestep_sampling shift is musubi-tuner\'s; wantrain\'s is --set model.timestep_sampling="sigmoid"' in (
        capsys.readouterr().err)


def test_every_peer_value_becomes_a_valid_wantrain_setting_and_is_in_config_md():
    from tests.test_first_hour_round3 import schema_keys
    from wantrain.app.config import RunConfig
    from wantrain.app.migration import PEER_VALUES, table_markdown
    from wantrain.core.config import check_value

    keys = schema_keys(RunConfig)
    for key, values in PEER_VALUES.items():
        for value, spelled in values.items():
            for wkey, wvalue in spelled.becomes.items():
                assert wkey in keys and wkey.endswith(f".{key}")
                section, name = wkey.split(".")
                check_value(type(getattr(RunConfig(), section)), name, wvalue, wkey)  # a value the key accepts
            assert f'| `{key} = "{value}"` | {spelled.peer} |' in table_markdown()
