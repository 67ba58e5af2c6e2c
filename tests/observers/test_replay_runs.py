"""`wantrain replay` on one real tiny run (the alpha run of test_alpha_runs, 20 steps, with the observers guide's
example observer attached): the unchanged config reproduces the recorded alpha transitions and metrics.jsonl, a
what-if with changed `min_steps` moves the transitions where the step arithmetic puts them, the run directory is
never modified, and observers that need the model are left out with a note."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from wantrain.app.replay import alpha_whatif, read, replay
from wantrain.cli.main import main
from wantrain.core.errors import UserError
from wantrain.observers.alpha.controller import AlphaChanged

from .test_alpha_runs import BASE, SCHEDULE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 20
LOG_EVERY, SWITCH_EVERY, WINDOW, MIN_SAMPLES = 5, 5, 10, 5  # as in test_alpha_runs' BASE and SCHEDULE



def _guide_example() -> str:
    text = (ROOT / "docs" / "observers.md").read_text()
    return re.search(r"<!-- observer-guide-example:start -->\s*```python\n(.*?)```", text, re.S).group(1)


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("replay_run")
    shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    (tmp / "loss_spikes.py").write_text(_guide_example(), encoding="utf-8")
    base = BASE.replace("record_events = true\n", "")  # recording is on by default
    assert base != BASE
    (tmp / "run.toml").write_text(base.format(steps=STEPS) + SCHEDULE.format(enabled="true"), encoding="utf-8")
    assert main(["run", str(tmp / "run.toml"), "--set", 'observers.extra=["loss_spikes:LossSpikes"]',
                 "--allow-code"]) == 0
    (run_dir,) = (tmp / "runs").iterdir()
    yield run_dir
    sys.modules.pop("loss_spikes", None)


@pytest.fixture
def in_config_dir(recorded_run, monkeypatch):
    monkeypatch.chdir(recorded_run.parents[1])  # replay imports the user's observer from the working directory
    monkeypatch.syspath_prepend(str(recorded_run.parents[1]))


def _metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in path.read_text().splitlines()]


def _trained_steps(expert: str, step: int) -> int:
    """Optimizer steps ``expert`` trained in steps 1..step: the experts alternate in stints of switch_every."""
    first = 0 if expert == "high_noise" else 1
    return sum(1 for s in range(1, step + 1) if ((s - 1) // SWITCH_EVERY) % 2 == first)


def _predicted(min_steps: tuple[int, int], window: int = WINDOW) -> list[tuple[int, str, str]]:
    """Transitions from the schedule's arithmetic alone (the other criteria are set wide open in CONFIG): the
    first look of a phase at max(min_steps, window) expert steps in it, with enough samples (observers.alpha)."""
    names = ("foundation", "balance", "emphasis")
    out = []
    phase = {"high_noise": 0, "low_noise": 0}
    start = {"high_noise": 0, "low_noise": 0}
    for step in range(LOG_EVERY, STEPS + 1, LOG_EVERY):
        for expert in ("high_noise", "low_noise"):
            steps = _trained_steps(expert, step)
            if steps == _trained_steps(expert, step - LOG_EVERY) or phase[expert] == 2:
                continue  # did not train in this interval, or in the last phase
            first = max(min_steps[phase[expert]], window)
            if steps - start[expert] >= first and min(steps, window) >= MIN_SAMPLES:
                phase[expert] += 1
                start[expert] = steps
                out.append((step, expert, names[phase[expert]]))
    return out


def test_unchanged_replay_reproduces_the_alpha_transitions_and_the_metrics_file(recorded_run, tmp_path,
                                                                                  in_config_dir):
    before = _tree_hash(recorded_run)
    result = replay(recorded_run, overrides=["observers.tensorboard=true"], out=tmp_path / "out")
    assert _tree_hash(recorded_run) == before  # the run is only read
    recorded = [e for e in read(recorded_run) if isinstance(e, AlphaChanged)]
    assert [(e.step, e.expert, e.to_phase) for e in recorded] == _predicted((10, 10))
    assert len(recorded) == 2
    assert [e for e in result.recorded if isinstance(e, AlphaChanged)] == recorded
    assert [e for e in result.replayed if isinstance(e, AlphaChanged)] == recorded
    live, again = _metrics(recorded_run / "metrics.jsonl"), _metrics(tmp_path / "out" / "metrics.jsonl")
    assert len(live) == STEPS // LOG_EVERY and again == live
    alpha_metrics = "alpha_metrics.jsonl"
    assert (tmp_path / "out" / alpha_metrics).read_bytes() == (recorded_run / alpha_metrics).read_bytes()
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    assert "(identical)" in alpha_whatif(result)
    assert any(note.startswith("norms: not replayable") for note in result.skipped)
    assert any(note.startswith("memory_probe: not replayable") for note in result.skipped)


def test_what_if_with_a_lower_min_steps_moves_the_transitions_where_predicted(recorded_run, tmp_path,
                                                                              in_config_dir, capsys):
    before = _tree_hash(recorded_run)
    args = ["replay", str(recorded_run), "--observers", "alpha", "--out", str(tmp_path / "whatif"),
            "--set", "lora.alpha_schedule.phases.0.min_steps=5", "--set", "lora.alpha_schedule.phases.1.min_steps=5",
            "--set", "lora.alpha_schedule.window=5"]  # the first look is at max(min_steps, window)
    assert main(args) == 0
    assert _tree_hash(recorded_run) == before
    printed = capsys.readouterr().out
    expected = _predicted((5, 5), window=5)
    assert expected != _predicted((10, 10))  # the what-if does move them
    # the table: per expert, each recorded transition beside the replayed one
    for step, expert, phase in expected:
        assert re.search(rf"\| step\s+{step}\s+\w+ -> {phase}", printed), (step, expert, phase)
    for step, _, phase in _predicted((10, 10)):
        assert re.search(rf"^\s+step\s+{step}\s+\w+ -> {phase} .*\|", printed, re.M)
    replayed = [json.loads(x) for x in (tmp_path / "whatif" / "alpha_metrics.jsonl").read_text().splitlines()]
    # the replay's own seed metrics show the phase in force before each decision under the what-if schedule
    assert [(x["step"], x["phase"]) for x in replayed] == [
        (5, "foundation"), (10, "foundation"), (15, "balance"), (20, "balance")]
    assert not (tmp_path / "whatif" / "metrics.jsonl").exists()  # only the alpha controller was replayed


def test_the_guide_example_observer_runs_live_and_in_replay(recorded_run, tmp_path, in_config_dir):
    import loss_spikes

    live_spikes = [e for e in read(recorded_run) if isinstance(e, loss_spikes.LossSpike)]
    assert live_spikes  # the tiny run's loss does spike at least once: the comparison below is not vacuous
    lines = (recorded_run / "loss_spikes.jsonl").read_text()
    assert [json.loads(x)["step"] for x in lines.splitlines()] == [e.step for e in live_spikes]
    sidecars = list((recorded_run / "checkpoints").glob("*/*_loss_spikes.json"))
    assert sidecars and "mean" in json.loads(sidecars[0].read_text())
    result = replay(recorded_run, observers=["LossSpikes"], out=tmp_path / "out", allow_code=True)
    assert list(result.replayed) == live_spikes == list(result.recorded)
    assert (tmp_path / "out" / "loss_spikes.jsonl").read_text() == lines


def test_until_stops_the_replay_after_that_step(recorded_run, tmp_path, in_config_dir):
    result = replay(recorded_run, observers=["jsonl"], until=12, out=tmp_path / "out")
    assert result.last_step == 12
    assert [m["step"] for m in _metrics(tmp_path / "out" / "metrics.jsonl")] == [5, 10]


def test_replay_refuses_to_write_into_the_run_or_a_used_folder(recorded_run, tmp_path, in_config_dir):
    before = _tree_hash(recorded_run)
    with pytest.raises(UserError, match="inside the run directory"):
        replay(recorded_run, out=recorded_run / "replay")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(UserError, match="not an empty folder"):
        replay(recorded_run, out=tmp_path / "used")
    with pytest.raises(UserError, match="no replayable observer selected"):
        replay(recorded_run, observers=["norms"], out=tmp_path / "n")
    with pytest.raises(UserError, match="'nope' is not an observer of this run"):
        replay(recorded_run, observers=["nope"], out=tmp_path / "n")
    assert _tree_hash(recorded_run) == before and not (tmp_path / "n").exists()


def test_a_user_observer_is_imported_from_beside_the_runs_config_and_only_with_allow_code(recorded_run, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # loss_spikes.py is not here: it is beside the config the run was started from
    monkeypatch.delitem(sys.modules, "loss_spikes", raising=False)
    result = replay(recorded_run, out=tmp_path / "found", allow_code=True)
    assert "LossSpikes" in result.observers  # found where run found it, not only in the working directory
    monkeypatch.delitem(sys.modules, "loss_spikes", raising=False)
    result = replay(recorded_run, observers=["jsonl"], out=tmp_path / "out")
    assert result.observers == ("JsonlMetrics",)
    result = replay(recorded_run, out=tmp_path / "out2")  # no --allow-code: left out with a note, not imported
    assert any(n.startswith("loss_spikes:LossSpikes: not imported") and "--allow-code" in n for n in result.skipped)
    assert "loss_spikes" not in sys.modules
    with pytest.raises(UserError, match="would import and run code.*--allow-code"):
        replay(recorded_run, observers=["LossSpikes"], out=tmp_path / "out3")
    summary = json.loads((tmp_path / "out2" / "replay.json").read_text())
    assert summary["source"] == str(recorded_run) and summary["skipped"] == list(result.skipped)
    assert (tmp_path / "out2" / "replay_config.toml").is_file()
    assert not (tmp_path / "out2" / "config.toml").exists()  # a replay folder is not mistaken for a run


def test_a_user_observer_that_cannot_be_imported_is_left_out_with_a_note(recorded_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "loss_spikes", raising=False)
    source = recorded_run.parents[1] / "loss_spikes.py"
    hidden = source.rename(source.with_suffix(".hidden"))  # nowhere to import it from
    try:
        result = replay(recorded_run, out=tmp_path / "out", allow_code=True)
        assert any(n.startswith("loss_spikes:LossSpikes: not imported") for n in result.skipped)
        with pytest.raises(UserError, match=r"cannot import module 'loss_spikes'.*replay imports users' observers "
                                            r"from '.*', '.*' and the installed packages"):
            replay(recorded_run, observers=["LossSpikes"], out=tmp_path / "out3", allow_code=True)
    finally:
        hidden.rename(source)
