"""Values that cannot be right are refused in one line by `check` and `run` alike, before anything is written
(issue 35): a LoRA rank wider than the layers it adapts, a step count no run can reach, a plan no device holds,
and a learning rate no LoRA trains with for its optimizer type (issue 39)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_end_to_end import copy_examples

from wantrain.app.config import RunConfig
from wantrain.app.memory_plan import LARGEST_DEVICE_GIB, plan_memory
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import UserError


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return copy_examples(tmp_path_factory.mktemp("values"))


@pytest.mark.parametrize(("override", "says"), [
    ("lora.rank=1000000000", "needs 15,522 GiB of device memory even with the smallest setting"),
    ("train.max_steps=1000000000000000000", "'train.max_steps' = 1000000000000000000 is out of range; expected >= 1 "
                                            "and <= 1000000000"),
    ("optimizer.lr=50", "optimizer.lr = 50 with optimizer.type = 'adamw' is no learning rate a LoRA trains with"),
    ("model.lr_high_noise=20.0", "model.lr_high_noise = 20 with optimizer.type = 'adamw'"),
])
def test_a_value_that_cannot_be_right_is_one_line_from_check_and_run(config, capsys, override, says):
    for command in ("check", "run"):
        code = main([command, str(config), "--set", override])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (config.parent / "runs").exists()


def test_a_rank_wider_than_the_layers_is_one_warning_line_from_check_and_run(config, capsys, tmp_path):
    """A config for A14B tried on the tiny twin (rank 32 on 24-wide layers) still trains; both commands say once
    that the extra rank buys nothing."""
    code = main(["check", str(config), "--set", "lora.rank=25"])
    out = capsys.readouterr()
    assert code == 0, out.err
    says = "'lora.rank' = 25 is wider than the layers it adapts: the narrowest Linear"
    assert (out.out + out.err).count(says) == 1 and "has 24 features" in out.out + out.err
    code = main(["run", str(config), "--set", "lora.rank=25", "--max-steps", "1",
                 "--set", f"run.output_dir={str(tmp_path)!r}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert (out.out + out.err).count(says) == 1


def test_the_widest_rank_and_a_prodigy_multiplier_are_accepted():
    from wantrain.models.wan22.rules import check_rank

    assert check_rank("tiny-t2v", 24) is None and "has 24 features" in check_rank("tiny-t2v", 25)
    assert check_rank("t2v-a14b", 5120) is None and "has 5120 features" in check_rank("t2v-a14b", 5121)
    assert structure(RunConfig, {"optimizer": {"type": "prodigy", "lr": 1.0}}).optimizer.lr == 1.0
    assert structure(RunConfig, {"optimizer": {"lr": 1e-3}}).optimizer.lr == 1e-3


def _report(width: int, height: int, frames: int) -> SimpleNamespace:
    bucket = SimpleNamespace(width=width, height=height, frames=frames)
    return SimpleNamespace(report=SimpleNamespace(buckets=[bucket], memory_plan=None, host_memory=None))


def test_a_plan_no_device_holds_is_refused_naming_the_bucket():
    cfg = structure(RunConfig, {"model": {"variant": "t2v-a14b"}, "sample": {"enabled": False}})
    with pytest.raises(UserError, match=rf"1920x1088x721 needs [0-9,]+ GiB .*the largest hold about "
                                        rf"{LARGEST_DEVICE_GIB:g} GiB"):
        plan_memory(cfg, _report(1920, 1088, 721))
    data = _report(832, 480, 81)
    plan_memory(cfg, data)  # the usual size: planned as before
    assert data.report.memory_plan["device_gib"] < LARGEST_DEVICE_GIB
