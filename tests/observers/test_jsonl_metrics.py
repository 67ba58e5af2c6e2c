"""JsonlMetrics: one parseable line per log step carrying the fields documented in docs/metrics.md."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from wantrain.core.bus import Bus
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import MetricsLogged, RunStarted
from wantrain.observers.jsonl_metrics import JsonlMetrics, read_metrics
from wantrain.observers.memory_probe import MemoryProbe
from wantrain.observers.norms import Norms

from .fakes import FakeLoop

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_fields() -> set[str]:
    """First-column fields of the table in docs/metrics.md (``train/grad_norm/<expert>`` style)."""
    return set(re.findall(r"^\| `([^`]+)` \|", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE))


def as_documented(field: str) -> str:
    field = re.sub(r"^train/lr/.+$", "train/lr/<group>", field)
    return re.sub(r"/(high_noise|low_noise)$", "/<expert>", field)


def emit_run(path: Path, start_step: int, steps: range, values: dict[str, float] | None = None) -> None:
    bus = Bus(Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live()))
    bus.attach(JsonlMetrics(path))
    bus.emit(RunStarted(step=start_step, run_dir="", total_steps=10, grad_accum=1, experts=(None,), log_every=1))
    for step in steps:
        bus.emit(MetricsLogged(step=step, expert=None, values=values or {"train/loss": float(step)},
                               elapsed_s=float(step), total_steps=10))
    bus.close()


def test_jsonl_lines_parse_and_carry_the_documented_fields(tmp_path):
    path = tmp_path / "metrics.jsonl"
    loop = FakeLoop([Norms(), MemoryProbe(), JsonlMetrics(path)], run_dir=tmp_path, total_steps=7, log_every=3)
    logged = loop.run()
    lines = path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [3, 6, 7]
    documented = documented_fields()
    for record, event in zip(records, logged, strict=True):
        assert {"step", "time", "elapsed_s", "expert"} <= set(record)
        assert record["expert"] == event.expert and record["elapsed_s"] == event.elapsed_s
        assert {k: v for k, v in record.items() if "/" in k} == event.values
        undocumented = {as_documented(k) for k in record} - documented
        assert not undocumented, f"fields missing from docs/metrics.md: {sorted(undocumented)}"


def test_jsonl_writes_non_finite_values_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    emit_run(path, 0, range(1, 2), values={"train/loss": math.nan, "train/grad_norm": math.inf})
    line = path.read_text(encoding="utf-8")
    assert json.loads(line)["train/loss"] is None and json.loads(line)["train/grad_norm"] is None
    assert "NaN" not in line and "Infinity" not in line


def test_jsonl_on_resume_keeps_only_lines_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    emit_run(path, 0, range(1, 9))  # crashed after step 8, last checkpoint at step 5
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 9, "train/lo')  # the line the crash cut short
    emit_run(path, 5, range(6, 8))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6, 7]
    assert all(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())


def test_jsonl_fresh_run_starts_an_empty_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    emit_run(path, 0, range(1, 4))
    emit_run(path, 0, range(1, 3))
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
