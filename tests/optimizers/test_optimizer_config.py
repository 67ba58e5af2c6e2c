"""The [optimizer] table: types and their defaults, keyword arguments checked against each class's signature (one
line naming optimizer.<key> and the valid keys), the allowlist for other classes, and the device check."""

from __future__ import annotations

import pytest
import torch

from tests.test_end_to_end import QUICKSTART
from wantrain.app.config import RunConfig
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError, UserError
from wantrain.core.trust import allowing_code
from wantrain.optimizers import OptimizerConfig, build_optimizer, check_optimizer


def optimizer(table: dict) -> OptimizerConfig:
    return structure(RunConfig, {"optimizer": table}).optimizer


def test_common_keys_take_the_types_defaults_and_keep_seed_names():
    assert optimizer({}).lr == 1e-4 and optimizer({}).beta1 == 0.9 and optimizer({}).eps == 1e-8
    assert optimizer({"type": "prodigy"}).lr == 1.0
    adafactor = optimizer({"type": "adafactor", "lr": 2e-4})
    assert adafactor.lr == 2e-4 and adafactor.beta1 is None and adafactor.beta2 is None


def test_a_wrong_keyword_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        optimizer({"type": "prodigy", "d_cof": 2.0})
    line = str(info.value)
    assert "\n" not in line and line.startswith("optimizer.d_cof is not an argument of prodigyopt.Prodigy")
    assert "did you mean 'optimizer.d_coef'?" in line and "safeguard_warmup" in line and "beta2" in line


def test_a_wrong_keyword_is_exit_code_2_with_one_line_and_no_run_directory(tmp_path, capsys):
    config = tmp_path / "q.toml"
    table = '[optimizer]\ntype = "adamw_schedulefree"\nwarmup_stepz = 10\n'
    text = QUICKSTART.read_text().replace("[optimizer]\n", table)
    config.write_text(text.replace('"../runs"', f"'{tmp_path / 'runs'}'"), encoding="utf-8")
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.warmup_stepz is not an argument of schedulefree.AdamWScheduleFree" in err[0]
    assert "did you mean 'optimizer.warmup_steps'?" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("table", "message"), [
    ({"type": "adafactor", "beta2": 0.99}, "optimizer.beta2 does not apply to type 'adafactor'"),
    ({"type": "adafactor", "relative_step": True}, "optimizer.relative_step = True is not supported"),
    ({"type": "adamw", "betas": [0.9, 0.99]}, "optimizer.betas cannot be set for torch.optim.AdamW"),
    ({"type": "prodigy", "d0": -1.0}, "rejected its arguments: Invalid d0 value: -1.0"),
    ({"type": "adamw8bit", "optim_bits": 32}, "optimizer.optim_bits cannot be set"),
    ({"type": "prodgy"}, "optimizer.type = 'prodgy' is not an optimizer type; did you mean 'prodigy'?"),
    ({"type": "adamw", "class": "torch.optim.SGD"}, "optimizer.class applies only to type = 'external'"),
    ({"type": "external", "class": "os.system"}, "allowed modules (torch.optim); run with --allow-code"),
    ({"type": "external", "class": "torch.optim.lr_scheduler.StepLR"}, "is not an optimizer class"),
    ({"type": "external", "class": "torch.optim.SGD", "beta1": 0.9, "beta2": 0.99}, "takes no betas"),
    ({"type": "external", "class": "torch.optim.SGD", "momentun": 0.9}, "did you mean 'optimizer.momentum'?"),
])
def test_refusals_are_one_line_naming_the_key(table, message):
    with pytest.raises(ConfigError, match=None) as info:
        optimizer(table)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_another_module_needs_allow_code_and_is_judged_before_import(monkeypatch):
    imported = []
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with pytest.raises(ConfigError):
        optimizer({"type": "external", "class": "prodigyopt.Prodigy"})
    with pytest.raises(ConfigError, match="allow_external_code = true in the config is not enough"):
        optimizer({"type": "external", "class": "prodigyopt.Prodigy", "allow_external_code": True, "lr": 1.0})
    assert "prodigyopt" not in imported
    with allowing_code():  # the person's --allow-code (wantrain.core.trust), not a key of the config
        cfg = optimizer({"type": "external", "class": "prodigyopt.Prodigy", "lr": 1.0})
        built = build_optimizer(cfg, [{"params": [torch.zeros(2, requires_grad=True)], "lr": 1.0}],
                                torch.device("cpu"))
    assert type(built).__name__ == "Prodigy"


def test_torch_optim_classes_are_allowed_by_name_with_their_keywords():
    cfg = optimizer({"type": "external", "class": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9})
    opt = build_optimizer(cfg, [{"params": [torch.zeros(2, requires_grad=True)], "lr": 0.1, "name": "lora"}],
                          torch.device("cpu"))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9


def test_adamw_is_fused_on_cpu_so_the_guard_skips_on_the_device():
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": 1e-3, "name": "lora"}]
    opt = build_optimizer(optimizer({}), groups, torch.device("cpu"))
    assert opt.param_groups[0]["fused"] and opt._step_supports_amp_scaling
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": 1e-3, "name": "lora"}]
    unfused = build_optimizer(optimizer({"fused": False}), groups, torch.device("cpu"))
    assert not getattr(unfused, "_step_supports_amp_scaling", False)


def test_a_backend_that_cannot_step_on_the_device_is_one_line(monkeypatch):
    import bitsandbytes

    def fail(self, closure=None):
        raise NotImplementedError("no kernel for this device\nsecond line")

    monkeypatch.setattr(bitsandbytes.optim.AdamW8bit, "step", fail)
    with pytest.raises(UserError) as info:
        check_optimizer(optimizer({"type": "adamw8bit"}), torch.device("cpu"))
    assert str(info.value) == ("optimizer.type = 'adamw8bit' cannot step on device cpu (NotImplementedError: no kernel "
                               "for this device); use a CUDA device or type = 'adamw'")


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"])
def test_every_type_steps_on_the_cpu(kind):
    check_optimizer(optimizer({"type": kind}), torch.device("cpu"))  # raises UserError when it cannot


@pytest.mark.parametrize("table, key", [
    ({"optimizer": {"type": "prodigy", "lr": 2e-3}}, "optimizer.lr = 0.002"),  # the quickstart's AdamW LR kept
    ({"optimizer": {"type": "prodigy", "lr": 50.0}}, "optimizer.lr = 50"),
    ({"optimizer": {"type": "prodigy"}, "model": {"lr_low_noise": 1e-4}}, "model.lr_low_noise = 0.0001"),
])
def test_an_adaptive_optimizers_multiplier_far_from_its_documented_value_is_refused(table, key):
    with pytest.raises(ConfigError) as info:
        structure(RunConfig, table)
    message = str(info.value)
    assert message.startswith(key) and "documented value 1" in message and "0.1 to 10" in message


def test_an_adaptive_optimizers_multiplier_near_its_documented_value_is_accepted():
    cfg = structure(RunConfig, {"optimizer": {"type": "prodigy", "lr": 0.5}, "model": {"lr_high_noise": 2.0}})
    assert cfg.optimizer.lr == 0.5 and cfg.model.lr_high_noise == 2.0
    assert structure(RunConfig, {"optimizer": {"lr": 2e-3}}).optimizer.lr == 2e-3  # AdamW: any positive LR


def test_prodigy_over_the_quickstart_is_refused_before_the_run_directory(tmp_path, capsys):
    from tests.test_end_to_end import copy_examples

    config = copy_examples(tmp_path)
    assert main(["run", str(config), "--set", 'optimizer.type="prodigy"']) == 2
    err = capsys.readouterr().err
    assert "optimizer.lr = 0.002 with optimizer.type = 'prodigy'" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
