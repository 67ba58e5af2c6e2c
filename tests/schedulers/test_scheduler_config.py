import pytest

from wantrain.app.config import RunConfig, load_config, to_plain
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError
from wantrain.schedulers import build_scheduler

from .helpers_sched import run_steps, sched_cfg, two_expert_optimizer

SEED_DECAY = """\
[lr_scheduler_config]
type = 'cosine_annealing_warm_restarts_decay'
T_0 = 1000
T_mult = 1
eta_min = 1e-7
gamma = 0.9  # Decay factor for restarts
"""
SEED_EXTERNAL = """\
[lr_scheduler_config]
type = 'external'
class = 'torch.optim.lr_scheduler.StepLR'
step_size = 30
gamma = 0.1
"""


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_seed_decay_example_parses_and_builds(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nmax_steps = 2500\n" + SEED_DECAY))
    sched = cfg.lr_scheduler
    assert (sched.type, sched.T_0, sched.T_mult, sched.eta_min, sched.gamma) == (
        "cosine_annealing_warm_restarts_decay", 1000, 1, 1e-7, 0.9)
    opt = two_expert_optimizer()
    scheduler = build_scheduler(sched, opt, total_steps=cfg.train.max_steps)
    lrs = run_steps(opt, scheduler, 2001)
    assert lrs[1000] == [1e-4 * 0.9, 5e-5 * 0.9]
    assert lrs[2000] == [1e-4 * 0.9**2, 5e-5 * 0.9**2]


def test_seed_external_example_parses_and_builds(tmp_path):
    cfg = load_config(write(tmp_path, SEED_EXTERNAL))
    sched = cfg.lr_scheduler
    assert sched.class_path == "torch.optim.lr_scheduler.StepLR"
    assert sched.external_arguments() == {"gamma": 0.1, "step_size": 30}
    opt = two_expert_optimizer()
    scheduler = build_scheduler(sched, opt, total_steps=100)
    lrs = run_steps(opt, scheduler, 31)
    assert lrs[29] == [1e-4, 5e-5]
    assert lrs[30] == pytest.approx([1e-5, 5e-6])


def test_unknown_key_for_a_builtin_type_suggests_the_close_key(tmp_path):
    text = "[lr_scheduler]\ntype = 'cosine_annealing_warm_restarts_decay'\nT_0 = 5\nT_mul = 2\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert str(err.value) == (
        "unknown config key 'lr_scheduler.T_mul' for type 'cosine_annealing_warm_restarts_decay': "
        "did you mean 'lr_scheduler.T_mult'?"
    )


def test_class_argument_with_a_builtin_type_points_to_external():
    with pytest.raises(ConfigError, match="type = 'external'"):
        sched_cfg(type="constant", step_size=30)


def test_key_of_another_type_is_reported_instead_of_ignored():
    with pytest.raises(ConfigError) as err:
        sched_cfg(type="cosine", T_0=100)
    assert "lr_scheduler.T_0 does not apply to type 'cosine'" in str(err.value)


def test_unknown_type_suggests_the_close_type():
    with pytest.raises(ConfigError, match="did you mean 'cosine'"):
        sched_cfg(type="cosin")


def test_seed_only_type_explains_how_to_write_it():
    with pytest.raises(ConfigError, match="ExponentialLR"):
        sched_cfg(type="exponential", gamma=0.9)


def test_decay_type_requires_t_0():
    with pytest.raises(ConfigError, match="lr_scheduler.T_0 is required"):
        sched_cfg(type="cosine_annealing_warm_restarts_decay")


def test_t_mult_below_one_is_rejected():
    with pytest.raises(ConfigError, match=r"lr_scheduler.T_mult = 0.5 is out of range; expected >= 1"):
        sched_cfg(type="cosine_annealing_warm_restarts_decay", T_0=10, T_mult=0.5)


def test_gamma_above_one_is_rejected_for_the_decay_type():
    with pytest.raises(ConfigError, match=r"lr_scheduler.gamma = 1.5 is out of range"):
        sched_cfg(type="cosine_annealing_warm_restarts_decay", T_0=10, gamma=1.5)


def test_negative_warmup_is_out_of_range():
    with pytest.raises(ConfigError, match=r"lr_scheduler.warmup_steps = -3 is out of range"):
        sched_cfg(warmup_steps=-3)


def test_default_section_is_constant_without_warmup():
    cfg = sched_cfg()
    assert (cfg.type, cfg.warmup_steps) == ("constant", 0)


def test_resolved_config_round_trips_through_its_plain_form(tmp_path):
    cfg = load_config(write(tmp_path, SEED_EXTERNAL))
    plain = to_plain(cfg)
    assert plain["lr_scheduler"]["step_size"] == 30  # written back as the user wrote it, not under `extra`
    again = structure(RunConfig, plain)
    assert again.lr_scheduler == cfg.lr_scheduler
