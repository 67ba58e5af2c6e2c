"""Every problem of a config in one report: a peer's key in any table beside wantrain's own unknown keys, and a file
value an override replaces (issue 58)."""

from __future__ import annotations

from tests.test_day_one_runs import workspace
from wantrain.cli.main import main


def test_every_peer_key_of_a_hand_written_config_is_named_in_one_check(tmp_path, capsys):
    config = workspace(tmp_path)
    text = config.read_text().replace("[lora]\nrank = 4", "[lora]\nnetwork_dim = 4")
    text = text.replace("[optimizer]\nlr = 3e-3", "[optimizer]\nlearning_rate = 3e-3\nlr_warmup_steps = 10")
    config.write_text(text.replace("max_steps = 8", "max_train_epochs = 3\nbogus_key = 1"))
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert "5 problems in the config, all of them:" in err, err
    for line in ("'network_dim' is musubi-tuner's name; wantrain's key for it is 'lora.rank'",
                 "'learning_rate' is musubi-tuner's name; wantrain's key for it is 'optimizer.lr'",
                 "'lr_warmup_steps' is musubi-tuner's name; wantrain's key for it is 'lr_scheduler.warmup_steps'",
                 "'max_train_epochs' is musubi-tuner's name; wantrain's key for it is 'train.max_epochs'",
                 "unknown config key 'train.bogus_key'"):
        assert line in err, line
    assert not (tmp_path / "runs").exists()


def test_a_wrong_type_in_the_file_is_reported_when_a_flag_overrides_the_key(tmp_path, capsys):
    config = workspace(tmp_path)
    config.write_text(config.read_text().replace("max_steps = 8", 'max_steps = "400"'))
    assert main(["run", str(config), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert ("config key 'train.max_steps' = '400' has the wrong type; expected an integer (in the file; the override "
            "replaces it for this run only)") in err, err
    assert not (tmp_path / "runs").exists()
    assert main(["check", str(config), "--set", "lora.rank=8"]) == 2  # an override of another key hides nothing
    assert "'train.max_steps' = '400' has the wrong type; expected an integer\n" in capsys.readouterr().err
