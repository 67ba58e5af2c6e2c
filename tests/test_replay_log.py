"""Reading event logs (`wantrain.core.events.log.read`): plain and gzip recordings, flushed at each optimizer
step, a torn tail, an unknown schema version, an unknown event type, the cut-back on resume;
`--set` indexing arrays of tables.
No model: events are made by hand and recorded through a real bus journal."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from wantrain.app.config import apply_overrides
from wantrain.cli.main import main
from wantrain.core.bus import Bus
from wantrain.core.errors import ConfigError, UserError
from wantrain.core.events import (
    CheckpointSaved,
    MetricsLogged,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    StepStarted,
)
from wantrain.core.events.log import event_log_path, iter_log_lines, read
from wantrain.observers.event_recorder import EventRecorder


def _events(steps: int) -> list:
    out = [RunStarted(step=0, run_dir="x", total_steps=steps, grad_accum=1, experts=(None,), log_every=2)]
    for s in range(1, steps + 1):
        out.append(StepStarted(step=s, micro_step=s, accumulation_index=1, ends_optimizer_step=True,
                               is_log_step=s % 2 == 0, expert=None))
        out.append(OptimizerStepped(step=s, expert=None, skipped=False, skip_reason=None, lrs=(1e-3,),
                                    group_names=("lora",), is_log_step=s % 2 == 0))
        if s % 2 == 0:
            out.append(MetricsLogged(step=s, expert=None, values={"train/loss": 1.0 / s}, elapsed_s=0.1 * s,
                                     total_steps=steps))
    return out


def _record(path: Path, events: list, *, keep_through_step: int = 0, close: bool = True) -> EventRecorder:
    recorder = EventRecorder(path, keep_through_step=keep_through_step)
    bus = Bus()
    recorder.attach_to(bus)
    for e in events:
        bus.emit(e)
    if close:
        bus.close()
    return recorder


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_recorded_events_read_back_as_equal_typed_events(tmp_path, compression):
    events = [*_events(6), RunEnded(step=6, status="completed", reason=None)]
    path = event_log_path(tmp_path, compression)
    _record(path, events)
    assert list(read(path)) == events
    assert list(read(tmp_path)) == events  # a run directory finds its log
    assert [e.step for e in read(path, until=3)] == [0, 1, 1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_records_are_readable_after_each_optimizer_step_while_the_run_goes_on(tmp_path, compression):
    path = event_log_path(tmp_path, compression)
    recorder = _record(path, _events(3), close=False)  # the writer is still open: nothing closed the stream
    try:
        got = list(read(path))
        assert got[-1] == _events(3)[-1] and len(got) == len(_events(3))
    finally:
        recorder.close()


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    _record(path, _events(4))
    complete = path.read_text()
    path.write_text(complete + '{"step":5,"micro_step":5,"accum')  # a crash mid-write
    with capture_logs() as logs:
        assert list(read(path)) == _events(4)
    assert [x["event"] for x in logs] == ["torn_last_line_skipped"]
    # valid JSON whose newline never made it counts as torn too: the writer died inside the record
    path.write_text(complete + json.dumps({"step": 5, "_type": "RunEnded", "status": "completed", "reason": None,
                                           "seq": 99, "wall_time": 0.0, "schema": 1}))
    assert list(read(path)) == _events(4)


def test_a_damaged_line_before_the_end_is_refused_with_its_line_number(tmp_path):
    path = tmp_path / "events.jsonl"
    _record(path, _events(2))
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "garbage\n"
    path.write_text("".join(lines))
    with pytest.raises(UserError, match=r"line 3 is not JSON"):
        list(read(path))


def test_a_gzip_log_cut_off_mid_stream_reads_up_to_the_last_flushed_step(tmp_path):
    path = tmp_path / "events.jsonl.gz"
    recorder = _record(path, _events(4), close=False)
    flushed = path.read_bytes()  # what a killed run leaves: no gzip trailer, the last step sync-flushed
    recorder.close()
    torn = tmp_path / "torn" / "events.jsonl.gz"
    torn.parent.mkdir()
    torn.write_bytes(flushed + b"\x00\x01garbage")
    assert list(read(torn)) == _events(4)


def test_an_unknown_schema_version_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    path = run / "events.jsonl"
    _record(path, _events(2))
    records = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "schema": 7}) + "\n" for r in records))
    with pytest.raises(UserError, match=r"schema version 7 .*reads version 1"):
        list(read(path))
    assert main(["replay", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "schema version 7" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_an_unknown_event_type_is_skipped_with_one_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    _record(path, _events(2))
    records = [json.loads(x) for x in path.read_text().splitlines()]
    own = {"step": 1, "_type": "MyOwnEvent", "detail": 3, "seq": 50, "wall_time": 0.0, "schema": 1}
    records[2:2] = [own, {**own, "step": 2}]
    records = [{**r, "seq": i} for i, r in enumerate(records, 1)]  # numbered as the bus numbers a real log
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with capture_logs() as logs:
        assert list(read(path)) == _events(2)
    warnings = [x for x in logs if x["event"] == "unknown_event_type_skipped"]
    assert len(warnings) == 1 and warnings[0]["event_type"] == "MyOwnEvent"
    assert any(x["event"] == "unknown_event_type_skipped_total" and x["records"] == 2 for x in logs)


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_resume_cuts_the_log_back_to_the_checkpoint_step_and_appends(tmp_path, compression):
    path = event_log_path(tmp_path, compression)
    _record(path, _events(6))  # the killed run got to step 6; the checkpoint was at step 4
    later = [RunStarted(step=4, run_dir="x", total_steps=6, grad_accum=1, experts=(None,), log_every=2,
                        resumed_from="ckpt"), *[e for e in _events(6) if e.step > 4]]
    _record(path, later, keep_through_step=4)
    assert list(read(path)) == [*[e for e in _events(6) if e.step <= 4], *later]
    if compression == "gzip":
        with gzip.open(path, "rt") as fh:  # still a valid gzip file for zcat and friends
            assert len(fh.read().splitlines()) == len(list(iter_log_lines(path)))


def test_set_indexes_arrays_of_tables_and_refuses_a_bad_index():
    data = {"lora": {"alpha_schedule": {"phases": [{"name": "a", "min_steps": 10}, {"name": "b"}]}}}
    apply_overrides(data, ["lora.alpha_schedule.phases.1.min_steps=5"])
    assert data["lora"]["alpha_schedule"]["phases"] == [{"name": "a", "min_steps": 10}, {"name": "b", "min_steps": 5}]
    with pytest.raises(ConfigError, match=r"'2' is not an index of that array \(0 to 1\)"):
        apply_overrides(data, ["lora.alpha_schedule.phases.2.min_steps=5"])


def test_every_toml_example_in_the_replay_and_observer_guides_is_valid_config():
    import re
    import tomllib

    from wantrain.app.config import RunConfig
    from wantrain.core.config import structure

    docs = Path(__file__).resolve().parents[1] / "docs"
    configs = [structure(RunConfig, tomllib.loads(block)) for name in ("replay.md", "observers.md")
               for block in re.findall(r"```toml\n(.*?)```", (docs / name).read_text(), flags=re.S)]
    assert [c.observers.record_compression for c in configs] == ["gzip", "none"]
    assert configs[1].observers.extra == ["loss_spikes:LossSpikes"] and configs[0].observers.record_events


def test_a_resumed_runs_log_replays_into_metrics_without_the_lost_steps(tmp_path):
    from wantrain.app.replay import replay

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[observers]\ntensorboard = false\n")
    path = event_log_path(run)
    _record(path, _events(6))  # killed after step 6; the checkpoint was at step 4
    resumed = [RunStarted(step=4, run_dir=str(run), total_steps=8, grad_accum=1, experts=(None,), log_every=2,
                          resumed_from="checkpoints/step_000004"), *[e for e in _events(8) if e.step > 4]]
    _record(path, resumed, keep_through_step=4)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    result = replay(run, observers=["jsonl"], out=tmp_path / "out")
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["train/loss"]) for x in lines] == [(s, 1.0 / s) for s in (2, 4, 6, 8)]
    assert result.last_step == 8 and {p.name: p.read_bytes() for p in run.iterdir()} == before


BESIDE_THE_CONFIG = """
import json
from pathlib import Path

from wantrain.core.events import MetricsLogged
from wantrain.observers import Observer, on


class StepList(Observer):
    replayable = True

    @on(MetricsLogged)
    def seen(self, event, ctx):
        with open(Path(ctx.run_dir) / "steps.jsonl", "a") as f:
            f.write(json.dumps(event.step) + "\\n")
"""


def test_replay_imports_users_observers_from_beside_the_runs_config_only_with_allow_code(tmp_path, monkeypatch):
    import sys

    from wantrain.app.observers import write_config_source
    from wantrain.app.replay import replay

    project = tmp_path / "project"  # the folder of the config the run was started from
    project.mkdir()
    (project / "beside_config_obs.py").write_text(BESIDE_THE_CONFIG)
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('[observers]\ntensorboard = false\nextra = ["beside_config_obs:StepList"]\n')
    write_config_source(run, project)  # what a run writes beside its config.toml
    _record(event_log_path(run), _events(6))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # replayed from another folder than the one holding the observer
    monkeypatch.delitem(sys.modules, "beside_config_obs", raising=False)
    refused = replay(run, out=tmp_path / "refused")
    assert "StepList" not in refused.observers and "beside_config_obs" not in sys.modules
    assert any("--allow-code" in note for note in refused.skipped)
    try:
        result = replay(run, out=tmp_path / "out", allow_code=True)
    finally:
        sys.modules.pop("beside_config_obs", None)
    assert "StepList" in result.observers
    assert (tmp_path / "out" / "steps.jsonl").read_text().split() == ["2", "4", "6"]


def test_a_stopped_and_resumed_runs_log_replays_as_one_run_without_dropped_events(tmp_path):
    from wantrain.app.replay import replay

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[observers]\ntensorboard = false\n")
    path = event_log_path(run)
    stopped = [*[e for e in _events(6) if e.step <= 4], RunEnded(step=4, status="stopped", reason="SIGINT")]
    _record(path, stopped)  # Ctrl-C at step 4: the stop saved a checkpoint there, then RunEnded
    resumed = [RunStarted(step=4, run_dir=str(run), total_steps=8, grad_accum=1, experts=(None,), log_every=2,
                          resumed_from="checkpoints/step_000004"), *[e for e in _events(8) if e.step > 4],
               RunEnded(step=8, status="completed", reason=None)]
    _record(path, resumed, keep_through_step=4)
    with capture_logs() as logs:
        result = replay(run, observers=["jsonl"], out=tmp_path / "out")
    assert not [x for x in logs if x.get("log_level") == "warning"], logs  # nothing dropped after a RunEnded
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4, 6, 8] and result.last_step == 8
    assert any("ended stopped at step 4 and was resumed" in n for n in result.notes)


# -- seq: the numbering of a log, checked by replay and by resume ---------------------------------------------------
def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda lines: lines[:4] + lines[5:], r"line 5: seq jumps from 4 \(line 4\) to 6: 1 record\(s\) are missing"),
    (lambda lines: lines[:5] + [lines[4]] + lines[5:], r"line 6: seq 5 repeats line 5 \(a duplicated record\)"),
    (lambda lines: lines[:4] + [lines[5], lines[4]] + lines[6:], r"line 5: seq jumps from 4"),
    (lambda lines: [lines[0], *lines], r"line 2: seq 1 repeats line 1"),  # a fresh RunStarted is no resume
    (lambda lines: lines[3:], r"line 1: the log starts at seq 4, not 1"),
], ids=["gap", "duplicate", "reorder", "first-line-twice", "head-removed"])
def test_a_log_with_records_removed_duplicated_or_reordered_is_refused_naming_the_line(tmp_path, edit, message):
    path = tmp_path / "events.jsonl"
    _record(path, _events(4))
    path.write_text("".join(edit(_lines(path))))
    with pytest.raises(UserError, match=message):
        list(read(path))


def test_a_resumed_run_starts_its_numbering_again_with_its_run_started(tmp_path):
    path = tmp_path / "events.jsonl"
    _record(path, [*_events(4), CheckpointSaved(step=4, paths=(), final=False, reason="every 4 steps",
                                                checkpoint="c4")])
    # the resumed process delivers again the CheckpointSaved already on record: the recorder leaves it out and
    # numbers the records after it so that no gap shows
    later = [RunStarted(step=4, run_dir="x", total_steps=6, grad_accum=1, experts=(None,), log_every=2,
                        resumed_from="c4"),
             CheckpointSaved(step=4, paths=(), final=False, reason="every 4 steps", checkpoint="c4"),
             *[e for e in _events(6) if e.step > 4]]
    _record(path, later, keep_through_step=4)
    events = list(read(path))
    assert [type(e).__name__ for e in events].count("CheckpointSaved") == 1
    assert [json.loads(x)["seq"] for x in _lines(path)][-len(later) + 1:] == list(range(1, len(later)))


def test_a_replay_of_a_damaged_log_is_one_line_and_leaves_nothing_in_out(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    path = run / "events.jsonl"
    _record(path, _events(8))
    lines = _lines(path)
    path.write_text("".join(lines[:12] + lines[13:]))  # a record removed late in the log
    out = tmp_path / "out"
    out.mkdir()  # an empty folder the user made is a valid --out
    assert main(["replay", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if "error:" in x]  # the replayed run log's info lines come first
    assert len(errors) == 1 and "line 13: seq jumps from 12" in errors[0] and "Traceback" not in err
    assert list(out.iterdir()) == []  # observers had written the first steps: none of it is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no partial sibling either
    path.write_text("".join(lines))
    assert main(["replay", str(run), "--out", str(out)]) == 0  # the intact log replays into the same folder
    assert (out / "replay.json").is_file() and (out / "metrics.jsonl").is_file()


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda lines: lines[:3] + ["garbage\n"] + lines[3:], "line 4 is not JSON"),
    (lambda lines: lines[:3] + lines[4:], "line 4: seq jumps from 3"),
], ids=["garbage", "gap"])
def test_resume_keeps_a_damaged_log_beside_it_and_names_the_line(tmp_path, damage, problem):
    path = tmp_path / "events.jsonl"
    _record(path, _events(6))
    damaged = "".join(damage(_lines(path)))
    path.write_text(damaged)
    later = [RunStarted(step=4, run_dir="x", total_steps=6, grad_accum=1, experts=(None,), log_every=2,
                        resumed_from="ckpt")]
    with capture_logs() as logs:
        _record(path, later, keep_through_step=4)
    warnings = [x for x in logs if x["event"] == "damaged_log_kept"]
    assert len(warnings) == 1 and warnings[0]["problem"].startswith(problem)
    copies = list(tmp_path.glob("events.jsonl.damaged-*"))
    assert [str(c) for c in copies] == [warnings[0]["copy"]] and copies[0].read_text() == damaged


def test_resume_of_an_intact_log_warns_nothing_and_keeps_no_copy(tmp_path):
    path = tmp_path / "events.jsonl"
    _record(path, _events(6))
    with capture_logs() as logs:
        _record(path, [RunStarted(step=4, run_dir="x", total_steps=6, grad_accum=1, experts=(None,), log_every=2,
                                  resumed_from="ckpt")], keep_through_step=4)
    assert not [x for x in logs if x["event"] == "damaged_log_kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]
