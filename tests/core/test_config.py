"""Config errors reach the user as one line naming the key, with exit code 2 and no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wantrain.app.compose import config_page
from wantrain.app.config import RunConfig, load_config
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp_path: Path, toml: str, capsys, *extra: str) -> tuple[int, str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    code = main(["run", str(cfg), *extra])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[train]\nlr = 0.001\n", "unknown config key 'train.lr': this key belongs at 'optimizer.lr'"),
        ("[train]\nmax_step = 5\n", "unknown config key 'train.max_step': did you mean 'train.max_steps'?"),
        ("[train]\nmax_steps = 'ten'\n",
         "config key 'train.max_steps' = 'ten' has the wrong type; expected an integer"),
        ("[optimizer]\nlr = -1.0\n", "config key 'optimizer.lr' = -1.0 is out of range; expected >= 0"),
        ("[nonsense]\nx = 1\n", "unknown config key 'nonsense'"),
    ],
    ids=["misplaced", "unknown", "wrong-type", "out-of-range", "unknown-table"],
)
def test_bad_config_gives_one_line_naming_the_key_and_exit_code_2(tmp_path, capsys, toml, expected):
    code, err = run_cli(tmp_path, toml, capsys)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing was created


def test_bad_set_override_is_checked_like_the_file(tmp_path, capsys):
    code, err = run_cli(tmp_path, "", capsys, "--set", "train.grad_accum=0")
    assert code == 2 and "'train.grad_accum' = 0 is out of range; expected >= 1" in err


def test_missing_config_file_is_one_line(tmp_path, capsys):
    code = main(["run", str(tmp_path / "nope.toml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err and len(err.splitlines()) == 1


def test_invalid_toml_is_one_line(tmp_path, capsys):
    code, err = run_cli(tmp_path, "[train\nmax_steps = 3", capsys)
    assert code == 2 and "is not valid TOML" in err and len(err.splitlines()) == 1


def test_cli_process_prints_no_traceback_for_a_config_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nvariant = 'tiny-tv2'\n")
    proc = subprocess.run([sys.executable, "-m", "wantrain.cli.main", "run", str(cfg)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "wantrain run: error: config key 'model.variant' = 'tiny-tv2' is not valid; expected one of 't2v-a14b', "
        "'i2v-a14b', 'ti2v-5b', 'vace-t2v-a14b', 'tiny-t2v', 'tiny-i2v', 'tiny-ti2v', 'tiny-vace-t2v' (did you mean "
        "'tiny-t2v'?)"
    ]


def test_set_overrides_parse_toml_values_and_bare_strings(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nmax_steps = 3\n")
    loaded = load_config(cfg, ["train.max_steps=7", "train.device=cpu", "optimizer.lr=2e-4"])
    assert loaded.train.max_steps == 7 and loaded.train.device == "cpu" and loaded.optimizer.lr == 2e-4


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    cfg = tmp_path / "sub" / "c.toml"
    cfg.parent.mkdir()
    cfg.write_text("[run]\noutput_dir = 'out'\n")
    assert load_config(cfg).run.output_dir == (tmp_path / "sub" / "out").resolve()


def test_seed_table_name_lr_scheduler_config_is_accepted():
    cfg = structure(RunConfig, {"lr_scheduler_config": {"type": "constant"}})
    assert cfg.lr_scheduler.type == "constant"
    with pytest.raises(ConfigError, match="given twice"):
        structure(RunConfig, {"lr_scheduler_config": {"type": "constant"}, "lr_scheduler": {"type": "constant"}})


def test_docs_config_md_is_generated_from_the_schema():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == config_page(), (
        "docs/config.md is stale: run `python -m wantrain.app.compose`"
    )


@pytest.mark.parametrize("name", ["../../escaped", "x/y", "", "..", "lora\n", "with space"])
def test_run_name_is_checked_with_the_run_id_rule_when_the_config_is_loaded(tmp_path, capsys, name):
    code, err = run_cli(tmp_path, f"[run]\nname = {json.dumps(name)}\n", capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"config key 'run.name' = {name!r} is not valid; expected 1-100 letters, digits" in err
    assert not (tmp_path / "runs").exists() and not list(tmp_path.parent.glob("escaped*"))


def test_run_id_is_checked_when_the_config_is_loaded(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'run.run_id' = 'a/b' is not valid; expected 1-100 letters"):
        structure(RunConfig, {"run": {"run_id": "a/b"}})
    assert structure(RunConfig, {"run": {"run_id": "exp_v1.2-a", "name": "my.lora"}}).run.name == "my.lora"


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"run": {"output_dir": ""}}, "run.output_dir"),
        ({"data": {"path": " "}}, "data.path"),
        ({"data": {"cache_dir": ""}}, "data.cache_dir"),
        ({"data": {"datasets": [{"path": ""}]}}, "data.datasets[0].path"),
        ({"model": {"path": ""}}, "model.path"),
    ],
)
def test_empty_path_keys_are_refused_naming_the_key(table, key):
    with pytest.raises(ConfigError) as info:
        structure(RunConfig, table)
    assert str(info.value).startswith(f"config key '{key}' = ")
    assert "is empty; expected a file or folder path" in str(info.value)


def test_tilde_in_config_paths_is_the_home_folder_not_a_folder_named_tilde(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    cfg = tmp_path / "project" / "c.toml"
    cfg.parent.mkdir()
    cfg.write_text(
        "[run]\noutput_dir = '~/runs'\n[model]\npath = '~/models/wan'\n"
        "[data]\ncache_dir = '~/cache'\n[[data.datasets]]\npath = '~/mydata'\n"
    )
    loaded = load_config(cfg, ["model.high_noise_file='~/high.safetensors'"])
    assert loaded.run.output_dir == home / "runs"
    assert loaded.model.path == home / "models" / "wan"
    assert loaded.model.high_noise_file == home / "high.safetensors"
    assert loaded.data.cache_dir == home / "cache"
    assert loaded.data.datasets[0].path == home / "mydata"
    assert load_config(cfg, ["data.datasets=[]", "data.path='~/other'"]).data.path == home / "other"


def test_tilde_of_an_unknown_user_is_one_line_naming_the_key():
    message = r"config key 'data.path' = '~no_such_user_wt17/x': cannot expand '~no_such_user_wt17' \(no such user"
    with pytest.raises(ConfigError, match=message):
        structure(RunConfig, {"data": {"path": "~no_such_user_wt17/x"}})


@pytest.mark.parametrize("seed", [2**64, 2**63, -1])
def test_run_seed_outside_what_torch_generators_take_is_one_line(tmp_path, capsys, seed):
    code, err = run_cli(tmp_path, f"[run]\nseed = {seed}\n", capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"config key 'run.seed' = {seed} is out of range; expected >= 0 and <= 9223372036854775807" in err


def test_largest_accepted_seed_seeds_torch():
    seed = structure(RunConfig, {"run": {"seed": 2**63 - 1}}).run.seed
    torch.manual_seed(seed)
    assert torch.Generator().manual_seed(seed).initial_seed() == seed


def test_a_section_built_in_code_is_refused_naming_the_key_like_the_toml_file():
    from wantrain.core.settings import TrainConfig

    with pytest.raises(ConfigError,
                       match=r"^config key 'train\.max_steps' = -5 is out of range; expected >= 1 and <= 1000000000$"):
        TrainConfig(max_steps=-5)


def test_an_evolve_with_a_bad_value_is_refused_naming_the_key():
    import attrs

    cfg = RunConfig()
    with pytest.raises(ConfigError, match=r"'validation\.every' = 0 is out of range"):
        attrs.evolve(cfg.validation, every=0)
    with pytest.raises(ConfigError, match=r"'run\.name' = '\.\./x' is not valid"):
        attrs.evolve(cfg.run, name="../x")
    with pytest.raises(ConfigError, match=r"'train\.clip_grad_norm' = 'big' has the wrong type; expected a number"):
        attrs.evolve(cfg.train, clip_grad_norm="big")


def test_an_item_of_a_list_section_is_named_by_its_path_in_the_file():
    with pytest.raises(ConfigError, match=r"^config key 'data\.datasets\[1\]\.repeats' = 0 is out of range"):
        structure(RunConfig, {"data": {"datasets": [{"path": "a"}, {"path": "b", "repeats": 0}]}})


def _float_keys() -> list[tuple[type, str, str, bool]]:
    """(section, field, key path, is a list) of every float key reachable from RunConfig."""
    import typing

    import attrs

    from wantrain.core.config import _Structurer

    found, seen = [], set()

    def walk(cls: type, path: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            tp, sub = hints[f.name], f"{path}.{f.name}" if path else f.name
            inner = _Structurer._section_of(tp)
            if inner is not None:
                if inner not in seen:
                    seen.add(inner)
                    walk(inner, sub + ("[0]" if typing.get_origin(tp) in (list, tuple) else ""))
            elif "float" in str(tp):
                found.append((cls, f.name, sub, typing.get_origin(tp) in (list, tuple) or "list" in str(tp)))

    walk(RunConfig, "")
    return found


def test_every_float_key_refuses_nan_and_infinities_naming_the_key():
    import math

    from wantrain.core.config import check_value

    keys = _float_keys()
    assert len(keys) > 40  # the walk reached every section
    for cls, name, path, is_list in keys:
        for bad in (math.nan, math.inf, -math.inf):
            value = [bad] if is_list else bad
            pattern = "^config key '" + re.escape(path) + r"(\[0\])?' = (nan|inf|-inf) is not a finite number"
            with pytest.raises(ConfigError, match=pattern):
                check_value(cls, name, value, path)


@pytest.mark.parametrize(("toml", "key"), [
    ("[optimizer]\neps = inf\n", "optimizer.eps"),
    ("[lora]\ndropout = nan\n", "lora.dropout"),
    ("[data]\npath = 'd'\ncaption_dropout = nan\n", "data.caption_dropout"),
    ("[optimizer]\nlr = nan\n", "optimizer.lr"),
    ("[optimizer]\ntype = 'prodigy'\nd_coef = inf\n", "optimizer.d_coef"),  # a table's extra argument
])
def test_non_finite_values_in_a_file_are_one_line_from_check_and_run(tmp_path, capsys, toml, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    for command in ("check", "run"):
        code = main([command, str(cfg)])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert f"config key '{key}' = " in err and "is not a finite number" in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_non_finite_value_built_in_code_is_refused_naming_the_key():
    import attrs

    cfg = RunConfig()
    with pytest.raises(ConfigError, match=r"^config key 'optimizer\.eps' = inf is not a finite number"):
        attrs.evolve(cfg.optimizer, eps=float("inf"))
    with pytest.raises(ConfigError, match=r"^config key 'lora\.dropout' = nan is not a finite number"):
        attrs.evolve(cfg.lora, dropout=float("nan"))
