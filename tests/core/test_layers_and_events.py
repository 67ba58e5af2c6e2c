"""Layering and the event catalogue's contract."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from wantrain.core.events import CATALOGUE, Event, from_record, to_record

CORE = Path(__file__).resolve().parents[2] / "wantrain" / "core"
FORBIDDEN = ("wantrain.observers", "wantrain.models", "wantrain.data", "wantrain.cli", "wantrain.schedulers",
             "wantrain.app.config")


def test_core_imports_nothing_from_observers_models_data_or_cli():
    offenders = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []


def test_importing_the_core_loads_no_other_wantrain_package():
    code = ("import sys, wantrain.core.loop, wantrain.core.bus, wantrain.core.config;"
            "print(sorted(m for m in sys.modules if m.startswith('wantrain.') and not m.startswith('wantrain.core')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _example(cls: type[Event]) -> Event:
    values = {}
    for f in attrs.fields(cls):
        tp = str(f.type)
        if f.name == "status":
            values[f.name] = "completed"
        elif f.name == "expert" or f.name == "previous":
            values[f.name] = "high_noise"
        elif "dict" in tp:
            values[f.name] = {"train/loss": 0.5}
        elif "tuple[tuple[int, str, int, int]" in tp:  # BatchDrawn's samples
            values[f.name] = ((0, "clip_000.mp4", 0, 9), (1, "image_000.png", 0, 1))
        elif "tuple[float" in tp:
            values[f.name] = (1e-4, 2e-4)
        elif "tuple[str | None" in tp:
            values[f.name] = ("high_noise", None)
        elif "tuple[str" in tp:
            values[f.name] = ("a", "b")
        elif "bool" in tp:
            values[f.name] = True
        elif "float" in tp:
            values[f.name] = 1.5
        elif "int" in tp:
            values[f.name] = 3
        else:
            values[f.name] = "text"
    return cls(**values)


@pytest.mark.parametrize("cls", CATALOGUE, ids=lambda c: c.__name__)
def test_every_event_is_frozen_slotted_and_round_trips_through_json(cls):
    event = _example(cls)
    assert "__dict__" not in dir(event) and hasattr(cls, "__slots__")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.step = 99  # type: ignore[misc]
    record = json.loads(json.dumps(to_record(event, seq=5, wall_time=1.0)))
    assert record["_type"] == cls.__name__ and record["seq"] == 5 and record["schema"] == 1
    assert from_record(record) == event
