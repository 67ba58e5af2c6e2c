"""Records every event to ``<run_dir>/events.jsonl`` (one JSON record per line, schema-versioned, sequenced).

It is a bus *journal*: it sees each event before any handler (write-ahead), so an event that crashes an observer
is still on record. Records are flushed at every log step (``OptimizerStepped`` with ``is_log_step``), at every
checkpoint (``CheckpointSaved``) and at the end of the run (and the file is closed by the bus after a crash), so a
process killed outright loses at most the records since the last log step -- records that resume cuts away anyway,
since it continues from a checkpoint. (Flushing at every step cost a write system call per step.)

Cost per event: the core's ``to_record`` and one JSON encoding with an encoder built once (``json.dumps`` with
non-default arguments builds a new encoder per call, which cost more than the encoding).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from wantrain.core.events import from_record

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class EventRecorder:
    """``keep_through_step``: on resume, records of later steps (the lost continuation of a killed run) and a
    torn last line are cut away before recording goes on; 0 (a fresh run) starts an empty file."""

    def __init__(self, path: Path, *, keep_through_step: int = 0) -> None:
        self.path = Path(path)
        _cut_back(self.path, keep_through_step)
        self._fh = self.path.open("a", encoding="utf-8")

    @property
    def name(self) -> str:
        return "EventRecorder"

    def attach_to(self, bus: Any) -> None:
        bus.add_journal(self.write, owner=self)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(_ENCODE(record) + "\n")
        kind = record["_type"]
        if (kind == "OptimizerStepped" and record.get("is_log_step")) or kind in ("RunEnded", "CheckpointSaved"):
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def _cut_back(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line of a killed run
            if line.endswith("\n") and isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def read_events(path: Path) -> list[Any]:
    """Events from a recording; a torn last line (a crash mid-write) is ignored."""
    events = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            events.append(from_record(json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return events
