"""`[lora.alpha_schedule]`: the documented example and the seed's I2V example load (the latter builds on the tiny
I2V twin), and bad schedules are refused with one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wantrain.app.config import load_config
from wantrain.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _load(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_the_docs_toml_example_is_a_valid_schedule(tmp_path):
    doc = (ROOT / "docs" / "alpha_schedule.md").read_text(encoding="utf-8")
    block = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    cfg = _load(tmp_path, block)
    schedule = cfg.lora.alpha_schedule
    assert schedule.enabled and [p.name for p in schedule.phases] == ["foundation", "balance", "emphasis"]
    assert cfg.lora.effective_alpha == 8.0
    assert schedule.phases[1].criterion("loss_improvement_rate_below", schedule.preset) == 0.005  # the preset's
    assert schedule.phases[1].criterion("max_loss_cv", schedule.preset) is None  # advisory unless a phase sets it


PHASES = """
[[lora.alpha_schedule.phases]]
name = "a"
alpha = 4
[[lora.alpha_schedule.phases]]
name = "b"
alpha = 8
"""


@pytest.mark.parametrize(("text", "message"), [
    ("[lora.alpha_schedule]\nenabled = true\ntargets = 'conv'\n" + PHASES, "no conv layers"),
    ("[lora.alpha_schedule]\nenabled = true\n[[lora.alpha_schedule.phases]]\nname = 'a'\nalpha = 4\n",
     "at least two"),
    ("[lora]\nalpha = 16\n[lora.alpha_schedule]\nenabled = true\n" + PHASES, "lora.alpha = 16 conflicts"),
    ("[lora.alpha_schedule]\nenabled = true\nwindow = 10\nmin_samples = 20\n" + PHASES, "exceeds window"),
    ("[lora.alpha_schedule]\nenabled = true\n[lora.alpha_schedule.conv_alpha_phases.a]\nalpha = 4\n"
     "[lora.alpha_schedule.conv_alpha_phases.a.exit_criteria]\nmin_loss_r3 = 0.1\n",
     "lora.alpha_schedule.conv_alpha_phases.a.exit_criteria.min_loss_r3"),
    ("[lora.alpha_schedule]\nenabled = true\ntransition = 'smooth'\n" + PHASES, "preserve_output"),
])
def test_bad_schedules_are_refused_with_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        _load(tmp_path, text)
    assert "\n" not in str(info.value)


def test_a_disabled_schedule_needs_no_phases_and_keeps_lora_alpha(tmp_path):
    cfg = _load(tmp_path, "[lora]\nrank = 8\nalpha = 3\n[lora.alpha_schedule]\nenabled = false\n")
    assert cfg.lora.effective_alpha == 3.0 and not cfg.lora.schedule_enabled


@pytest.mark.parametrize(("optimizer", "message"), [
    ("type = 'prodigy'", "optimizer.type = 'prodigy' across an alpha change (Prodigy's step size d"),
    ("type = 'external'\nclass = 'torch.optim.Adagrad'", "optimizer.class = 'torch.optim.Adagrad'"),
])
def test_preserve_output_with_an_optimizer_without_a_state_map_is_refused_when_read(tmp_path, optimizer, message):
    text = f"[optimizer]\n{optimizer}\n[lora.alpha_schedule]\nenabled = true\n" + PHASES
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        _load(tmp_path, text)
    assert "transition = 'jump'" in str(info.value) and "\n" not in str(info.value)
    jump = _load(tmp_path, text.replace("enabled = true", "enabled = true\ntransition = 'jump'"))
    assert jump.lora.alpha_schedule.transition == "jump"  # the seed's jump needs no map


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "adamw_schedulefree"])
def test_preserve_output_is_accepted_with_every_optimizer_that_has_a_map(tmp_path, optimizer):
    cfg = _load(tmp_path, f"[optimizer]\ntype = '{optimizer}'\n[lora.alpha_schedule]\nenabled = true\n" + PHASES)
    assert cfg.lora.alpha_schedule.transition == "preserve_output"


def test_switch_every_one_with_two_experts_warns_that_stability_does_not_apply(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="wantrain.alpha"):
        _load(tmp_path, "[model]\nvariant = 'tiny-t2v'\nexperts = 'both'\nswitch_every = 1\n"
                        "[lora.alpha_schedule]\nenabled = true\n" + PHASES)
    assert any("switch_every = 1" in r.getMessage() and "not applied" in r.getMessage() for r in caplog.records)


def test_built_in_observers_can_be_left_out_by_name_as_the_lr_finders_sweep_leaves_out_alpha(tmp_path):
    from wantrain.app.observers import build_observers

    cfg = _load(tmp_path, "[lora.alpha_schedule]\nenabled = true\n" + PHASES)
    names = {type(o).__name__ for o in build_observers(cfg, tmp_path)}
    assert "AlphaController" in names
    assert "AlphaController" not in {type(o).__name__ for o in build_observers(cfg, tmp_path, without=("alpha",))}
