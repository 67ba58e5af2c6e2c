import logging
import sys
import types

import pytest

from wantrain.core.errors import ConfigError
from wantrain.core.trust import allowing_code
from wantrain.schedulers import build_scheduler
from wantrain.schedulers.external import is_allowed

from .helpers_sched import run_steps, sched_cfg, two_expert_optimizer


def external(class_path, **args):
    return sched_cfg(type="external", **{"class": class_path}, **args)


@pytest.mark.parametrize("class_path", ["wantrain_no_such_module_x9.evil.Scheduler", "tabnanny.Scheduler"])
def test_class_outside_the_allowlist_is_refused_without_being_imported(class_path):
    module = class_path.rpartition(".")[0]
    top = module.split(".")[0]
    assert top not in sys.modules  # tabnanny is real but nothing here imports it
    with pytest.raises(ConfigError) as err:
        external(class_path, step_size=3)
    assert "outside wantrain's allowed modules" in str(err.value) and "--allow-code" in str(err.value)
    assert top not in sys.modules and module not in sys.modules


def test_allow_external_code_in_the_config_alone_allows_nothing():
    """The trust rule (wantrain.core.trust): a config cannot allow code itself; the person's --allow-code does."""
    with pytest.raises(ConfigError) as err:
        external("tabnanny.Scheduler", step_size=3, allow_external_code=True)
    assert "allow_external_code = true in the config is not enough" in str(err.value)
    assert "--allow-code" in str(err.value) and "\n" not in str(err.value)
    assert "tabnanny" not in sys.modules


def test_allowlist_matches_whole_module_names_only():
    assert is_allowed("torch.optim.lr_scheduler.StepLR")
    assert is_allowed("timm.scheduler.cosine_lr.CosineLRScheduler")
    assert not is_allowed("torch.optim.lr_scheduler_evil.StepLR")
    assert not is_allowed("torch.optim.SGD")


def test_allow_code_imports_another_module_and_warns(tmp_path, monkeypatch, caplog):
    (tmp_path / "wantrain_test_user_sched.py").write_text(
        "import torch\n"
        "class HalveEvery(torch.optim.lr_scheduler.StepLR):\n"
        "    def __init__(self, optimizer, every):\n"
        "        super().__init__(optimizer, step_size=every, gamma=0.5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wantrain_test_user_sched", raising=False)
    with caplog.at_level(logging.WARNING, logger="wantrain.schedulers"), allowing_code():
        cfg = sched_cfg(type="external", **{"class": "wantrain_test_user_sched.HalveEvery"}, every=2)
        opt = two_expert_optimizer()
        scheduler = build_scheduler(cfg, opt, total_steps=10)
    assert "outside the allowed modules (--allow-code)" in caplog.text
    lrs = run_steps(opt, scheduler, 5)
    assert [lr[0] for lr in lrs] == pytest.approx([1e-4, 1e-4, 5e-5, 5e-5, 2.5e-5])


def test_non_scheduler_class_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        external("torch.optim.lr_scheduler.Optimizer")
    assert str(err.value) == (
        "lr_scheduler.class = 'torch.optim.lr_scheduler.Optimizer' is not a learning-rate scheduler (expected a "
        "subclass of torch.optim.lr_scheduler.LRScheduler or a timm.scheduler class)"
    )


def test_function_instead_of_class_is_a_one_line_error():
    with pytest.raises(ConfigError, match="is not a class"):
        external("torch.optim.lr_scheduler.cast")


def test_wrong_argument_name_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        external("torch.optim.lr_scheduler.StepLR", step_sz=30)
    assert str(err.value) == (
        "lr_scheduler.step_sz is not an argument of torch.optim.lr_scheduler.StepLR; "
        "did you mean 'lr_scheduler.step_size'?"
    )


def test_missing_required_argument_is_named():
    with pytest.raises(ConfigError, match=r"^lr_scheduler.step_size is required by torch.optim.lr_scheduler.StepLR"):
        external("torch.optim.lr_scheduler.StepLR", gamma=0.5)


def test_argument_value_the_class_rejects_is_reported_at_config_time():
    with pytest.raises(ConfigError, match=r"LinearLR\(start_factor=2.0\) rejected its arguments: Starting"):
        external("torch.optim.lr_scheduler.LinearLR", start_factor=2.0)


def test_last_epoch_is_refused_because_resume_uses_the_state_dict():
    with pytest.raises(ConfigError, match="lr_scheduler.last_epoch cannot be set"):
        external("torch.optim.lr_scheduler.StepLR", step_size=3, last_epoch=5)


def test_reduce_lr_on_plateau_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="device-to-host sync"):
        external("torch.optim.lr_scheduler.ReduceLROnPlateau")


def test_warmup_with_an_external_class_is_refused():
    with pytest.raises(ConfigError, match="warmup_steps is not supported with type = 'external'"):
        external("torch.optim.lr_scheduler.StepLR", step_size=3, warmup_steps=10)


def test_unknown_class_in_allowed_module_suggests_the_close_name():
    with pytest.raises(ConfigError, match="did you mean 'torch.optim.lr_scheduler.StepLR'"):
        external("torch.optim.lr_scheduler.StepLr", step_size=3)


class _FakeTimmScheduler:
    """Stands in for a timm scheduler: stateless in time, driven by step_update(num_updates)."""

    def __init__(self, optimizer, t_initial, t_in_epochs=False):
        self.optimizer, self.t_initial, self.t_in_epochs = optimizer, t_initial, t_in_epochs
        self.base_values = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]

    def _set(self, t):
        for g, base in zip(self.optimizer.param_groups, self.base_values):
            g["lr"] = base * 0.5 ** (t // self.t_initial)

    def step(self, epoch, metric=None):
        if self.t_in_epochs:
            self._set(epoch)

    def step_update(self, num_updates, metric=None):
        if not self.t_in_epochs:
            self._set(num_updates)

    def state_dict(self):
        return {"t_initial": self.t_initial}

    def load_state_dict(self, state):
        self.t_initial = state["t_initial"]


_FakeTimmScheduler.__module__ = "timm.scheduler.fake_lr"


def test_timm_scheduler_is_driven_by_the_optimizer_step_count(monkeypatch):
    timm = types.ModuleType("timm")
    timm_scheduler = types.ModuleType("timm.scheduler")
    timm_scheduler.FakeLRScheduler = _FakeTimmScheduler
    timm.scheduler = timm_scheduler
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.scheduler", timm_scheduler)
    cfg = external("timm.scheduler.FakeLRScheduler", t_initial=3)
    opt = two_expert_optimizer()
    scheduler = build_scheduler(cfg, opt, total_steps=10)
    lrs = run_steps(opt, scheduler, 7)
    assert [lr[1] for lr in lrs] == [5e-5] * 3 + [2.5e-5] * 3 + [1.25e-5]
    state = scheduler.state_dict()
    fresh = two_expert_optimizer()
    resumed = build_scheduler(cfg, fresh, total_steps=10)
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == scheduler.get_last_lr()
