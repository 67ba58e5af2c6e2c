import argparse
from types import SimpleNamespace

from wantrain.cli import schedule
from wantrain.schedulers.preview import key_points, sample

from .helpers_sched import sched_cfg

CONFIG = """\
[model]
variant = "tiny-t2v"
[optimizer]
lr = 2e-4
[train]
max_steps = 120
[lr_scheduler]
type = "cosine_annealing_warm_restarts_decay"
T_0 = 30
gamma = 0.5
warmup_steps = 0.1
"""


def run_cli(argv):
    parser = argparse.ArgumentParser()
    schedule.add_arguments(parser)
    return schedule.run(parser.parse_args(argv))


def test_schedule_command_writes_a_png_and_prints_the_key_points(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    out = tmp_path / "plots" / "lr.png"
    assert run_cli([str(config), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines()[2:] if line.strip()[:1].isdigit()}
    # numbered from 1, as the progress line and metrics.jsonl number the steps (issue 49)
    assert "first step" in rows["1"] and "end of warmup" in rows["13"] and "2.0000e-04" in rows["13"]
    assert "restart 1" in rows["43"] and "1.0000e-04" in rows["43"]
    assert "restart 2" in rows["73"] and "restart 3" in rows["103"] and "last step" in rows["120"]
    assert "groups: high_noise, low_noise" in text


def test_schedule_command_writes_lr_schedule_png_in_the_current_directory_by_default(tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text("[train]\nmax_steps = 5\n")
    monkeypatch.chdir(tmp_path)
    assert run_cli(["run.toml"]) == 0
    assert (tmp_path / "lr_schedule.png").is_file()


def test_set_overrides_reach_the_preview(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    run_cli([str(config), "--out", str(tmp_path / "x.png"), "--set", "train.max_steps=60"])
    assert "over 60 optimizer steps" in capsys.readouterr().out


def model_cfg(variant, **model):
    return SimpleNamespace(model=SimpleNamespace(variant=variant, **model), optimizer=SimpleNamespace(lr=1e-4))


def test_preview_groups_follow_the_variant_experts():
    assert schedule.group_base_lrs(model_cfg("i2v-a14b")) == {"high_noise": 1e-4, "low_noise": 1e-4}
    assert schedule.group_base_lrs(model_cfg("ti2v-5b")) == {"lora": 1e-4}


def test_preview_uses_per_expert_lr_when_the_model_section_has_one():
    cfg = model_cfg("tiny-i2v", lr_high_noise=3e-4, lr_low_noise=None)
    assert schedule.group_base_lrs(cfg) == {"high_noise": 3e-4, "low_noise": 1e-4}


def test_external_preview_lists_steps_where_the_lr_rises():
    cfg = sched_cfg(type="external", **{"class": "torch.optim.lr_scheduler.CosineAnnealingWarmRestarts"}, T_0=10)
    lrs = sample(cfg, {"lora": 1e-4}, 25)
    assert [s for s, label in key_points(cfg, lrs, 25) if label == "LR rises"] == [10, 20]


def test_preview_has_the_loraplus_b_groups_at_the_ratio():
    cfg = model_cfg("tiny-i2v", lr_high_noise=3e-4, lr_low_noise=None)
    cfg.lora = SimpleNamespace(plus_lr_ratio=16.0)
    assert schedule.group_base_lrs(cfg) == {"high_noise": 3e-4, "high_noise_B": 3e-4 * 16, "low_noise": 1e-4,
                                            "low_noise_B": 1e-4 * 16}
