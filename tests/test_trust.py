"""What a config may run (``wantrain.core.trust``, docs/observers.md "What a config may run"): code a config names
outside wantrain's allowed modules -- a users' observer, an optimizer or scheduler class from another module -- is
imported only with the person's ``--allow-code`` / ``allow_code=True``; a config cannot allow it itself, not even with
``allow_external_code = true``. Every refusal is one line, exit code 2, before the run directory exists and before
the module's code has run (each module here leaves a marker file when it is imported)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_end_to_end import copy_examples

import wantrain
from wantrain.app.observers import load_observer_class
from wantrain.cli.main import main
from wantrain.core.errors import UserError

pytestmark = pytest.mark.slow

MARK = "from pathlib import Path\n(Path(__file__).parent / 'imported_{name}').touch()  # top-level code ran\n"

OBSERVER = MARK.format(name="watch_observers") + '''
import json

from wantrain.core.events import MetricsLogged, RunEnded
from wantrain.observers import Observer, on


class Watch(Observer):
    def __init__(self):
        self.seen = 0

    @on(MetricsLogged)
    def count(self, event, ctx):
        self.seen += 1

    @on(RunEnded)
    def done(self, event, ctx):
        done = {"seen": self.seen, "status": event.status}
        (Path(__file__).parent / "watch_done.json").write_text(json.dumps(done))
'''

OPTIMIZER = MARK.format(name="my_optim") + '''
import torch


class MySGD(torch.optim.SGD):
    pass
'''

WATCH = ["--set", 'observers.extra=["watch_observers:Watch"]']
EXTERNAL_OPTIMIZER = ["--set", 'optimizer.type="external"', "--set", 'optimizer.class="my_optim.MySGD"',
                      "--set", "optimizer.allow_external_code=true", "--set", "optimizer.lr=1e-3"]
EXTERNAL_SCHEDULER = ["--set", 'lr_scheduler.type="external"', "--set", 'lr_scheduler.class="my_optim.MySGD"',
                      "--set", "lr_scheduler.allow_external_code=true", "--set", "lr_scheduler.warmup_steps=0"]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    config = copy_examples(tmp_path)
    (tmp_path / "watch_observers.py").write_text(OBSERVER, encoding="utf-8")
    (tmp_path / "my_optim.py").write_text(OPTIMIZER, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the working directory holds the modules too: it does not make them trusted
    monkeypatch.syspath_prepend(str(tmp_path))  # and they are importable, as if installed: that does not either
    yield config
    for name in ("watch_observers", "my_optim"):
        sys.modules.pop(name, None)


def refused(capsys, code: int, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"wantrain {command}: error: ") and "Traceback" not in err
    assert "--allow-code" in err and "a config cannot allow code itself" in err
    return err


def nothing_ran(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("imported_*")), "a refused module's top-level code ran"
    assert not (tmp_path / "runs").exists()


REFUSED = {
    "run, users' observer": (["run"], WATCH, "observers.extra[0] = 'watch_observers:Watch'"),
    "run, external optimizer with allow_external_code": (
        ["run"], EXTERNAL_OPTIMIZER, "allow_external_code = true in the config is not enough"),
    "run, external scheduler with allow_external_code": (
        ["run"], EXTERNAL_SCHEDULER, "lr_scheduler.class = 'my_optim.MySGD'"),
    "LR finder, users' observer": (["run", "--lr-finder"], WATCH, "observers.extra[0]"),
    "LR finder then train, external optimizer": (["run", "--lr-finder-then-train"], EXTERNAL_OPTIMIZER,
                                                 "optimizer.class = 'my_optim.MySGD'"),
    "check, users' observer": (["check"], WATCH, "observers.extra[0]"),
    "check, external optimizer": (["check"], EXTERNAL_OPTIMIZER, "optimizer.class"),
    "cache, external optimizer": (["cache"], EXTERNAL_OPTIMIZER, "optimizer.class"),
    "schedule, external scheduler": (["schedule"], EXTERNAL_SCHEDULER, "lr_scheduler.class"),
}


@pytest.mark.parametrize(("command", "settings", "expected"), REFUSED.values(), ids=REFUSED.keys())
def test_code_a_config_names_is_refused_without_allow_code_before_it_runs(workspace, capsys, command, settings,
                                                                         expected):
    code = main([command[0], str(workspace), *command[1:], *settings])
    assert expected in refused(capsys, code, command[0])
    nothing_ran(workspace.parent)


def test_the_python_api_refuses_a_users_observer_unless_allow_code(workspace):
    with pytest.raises(UserError, match=r"observers.extra\[0\] = 'watch_observers:Watch' would import .*allow_code"):
        wantrain.train(workspace, overrides=['observers.extra=["watch_observers:Watch"]'])
    nothing_ran(workspace.parent)


def test_wantrains_own_modules_need_no_allow_code():
    cls = load_observer_class("wantrain.observers.norms:Norms")
    assert cls.__name__ == "Norms"
    with pytest.raises(UserError, match="would import and run code"):
        load_observer_class("wantrain_lookalike.observers:Norms")  # judged by the whole top-level package name


def test_allow_code_runs_the_users_observer_in_check_and_in_the_lr_finder_from_python(workspace, capsys):
    tmp = workspace.parent
    assert main(["check", str(workspace), *WATCH, "--allow-code"]) == 0
    assert (tmp / "imported_watch_observers").exists() and not (tmp / "runs").exists()
    capsys.readouterr()
    outcome = wantrain.train(workspace, overrides=['observers.extra=["watch_observers:Watch"]',
                                                   "lr_finder.enabled=true", "lr_finder.steps=5",
                                                   "lr_finder.burn_in=0", "observers.progress=false"],
                             allow_code=True)
    assert outcome.lr_finder_dir is not None
    done = json.loads((tmp / "watch_done.json").read_text())
    assert done["status"] == "completed" and done["seen"] > 0  # attached to the sweep, saw its log steps


def test_allow_code_runs_an_external_optimizer_named_in_the_config(workspace, capsys):
    tmp = workspace.parent
    code = main(["run", str(workspace), *EXTERNAL_OPTIMIZER, "--max-steps", "2", "--set", "observers.progress=false",
                 "--allow-code"])
    assert code == 0, capsys.readouterr().err
    assert (tmp / "imported_my_optim").exists()
    (run_dir,) = (tmp / "runs").iterdir()
    assert (run_dir / "quickstart_high_noise.safetensors").exists()
