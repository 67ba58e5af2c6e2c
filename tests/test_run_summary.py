"""What ``wantrain run`` prints when a run ends (``wantrain.cli.run.summary``), per torchrun rank: only rank 0, whose
run directory and checkpoints they are, prints the summary (issue 29: rank 1 printed "completed" with a stale
checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wantrain.app.assemble import RunOutcome
from wantrain.cli.main import main


@pytest.fixture
def fake_train(monkeypatch):
    outcomes = []

    def train(config, *, overrides=(), resume=None, allow_code=False, allow_data_changes=False):
        return outcomes.pop(0)

    monkeypatch.setattr("wantrain.app.train.train", train)
    return outcomes


def outcome(rank: int, status: str = "completed") -> RunOutcome:
    return RunOutcome(status, None if status == "completed" else "stop requested", 12, Path("/runs/r"),
                      ("/runs/r/lora.safetensors",), "/runs/r/checkpoints/step_000008", rank=rank)


def test_only_rank_0_prints_the_run_summary(fake_train, capsys):
    fake_train.extend([outcome(1), outcome(1, "stopped"), outcome(0)])
    assert main(["run", "any.toml"]) == 0
    assert main(["run", "any.toml"]) == 0  # another rank exits 0 whatever the status (RunOutcome.exit_code)
    out, err = capsys.readouterr()
    out = "".join(line for line in out.splitlines(True) if not line.startswith("wantrain run: "))  # the loading lines
    assert out == "" and err == ""  # no "completed", no checkpoint that rank 0 may have superseded
    assert main(["run", "any.toml"]) == 0
    err = capsys.readouterr().err
    assert "wantrain: run completed after 12 steps; run directory: /runs/r" in err
    assert "checkpoint: /runs/r/checkpoints/step_000008" in err


def test_the_continue_command_repeats_allow_code(fake_train, capsys):
    fake_train.append(outcome(0, "stopped"))
    assert main(["run", "cfg.toml", "--allow-code", "--max-steps", "20"]) == 3
    assert "continue with: wantrain run cfg.toml --max-steps 20 --allow-code --resume auto" in capsys.readouterr().err
