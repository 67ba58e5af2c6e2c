"""``bench/check_overhead.py`` (issue 62): the before-stop check of the default observers' cost. Its counting runs
under valgrind and takes minutes, so it is not run here; what is tested is its verdict on given counts and the runs
it compares."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check_overhead():
    sys.path.insert(0, str(ROOT / "bench"))  # it imports its sibling callgrind.py
    spec = importlib.util.spec_from_file_location("check_overhead", ROOT / "bench" / "check_overhead.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_check_passes_at_the_target_and_fails_under_it(check_overhead):
    # the figures at f47fedc: 34.66 M instructions per step without the observers, 35.83 M with them
    ratio, passed = check_overhead.verdict({"off": 34.66e6, "on": 35.83e6}, 0.99)
    assert ratio == pytest.approx(0.9673, abs=1e-4)
    assert not passed
    assert check_overhead.verdict({"off": 99.0, "on": 100.0}, 0.99) == (0.99, True)
    assert check_overhead.verdict({"off": 34.92e6, "on": 35.12e6}, 0.99)[1]


def test_a_count_that_is_not_positive_is_refused(check_overhead):
    with pytest.raises(ValueError, match="positive"):
        check_overhead.verdict({"off": 0.0, "on": 35e6}, 0.99)


def test_the_off_run_turns_off_every_default_observer_and_both_runs_are_the_same_quickstart(check_overhead):
    from wantrain.app.config import load_config

    off = load_config(check_overhead.QUICKSTART, check_overhead.overrides("off", 30, 10, Path("/tmp/unused")))
    on = load_config(check_overhead.QUICKSTART, check_overhead.overrides("on", 30, 10, Path("/tmp/unused")))
    for cfg in (off, on):
        assert (cfg.train.max_steps, cfg.train.log_every) == (30, 10)
        assert not cfg.validation.enabled and not cfg.sample.enabled
    for switch in check_overhead.DEFAULT_OBSERVER_SWITCHES:
        assert getattr(on.observers, switch) is True  # the default run has it on ...
        assert getattr(off.observers, switch) is False  # ... and the run without observers off
    assert (on.model, on.lora, on.optimizer) == (off.model, off.lora, off.optimizer)
