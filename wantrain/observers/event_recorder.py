"""Records every event to ``<run_dir>/events.jsonl`` (one JSON record per line, schema-versioned, sequenced).

It is a bus *journal*: it sees each event before any handler (write-ahead), so an event that crashes an observer
is still on record. Records are flushed at every optimizer step and at the end of the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wantrain.core.events import from_record


class EventRecorder:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fh = self.path.open("a", encoding="utf-8")

    @property
    def name(self) -> str:
        return "EventRecorder"

    def attach_to(self, bus: Any) -> None:
        bus.add_journal(self.write, owner=self)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        if record["_type"] in ("OptimizerStepped", "RunEnded", "CheckpointSaved"):
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


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
