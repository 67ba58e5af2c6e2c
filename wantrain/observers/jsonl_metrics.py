"""One JSON object per log step in ``<run_dir>/metrics.jsonl`` (schema: ``docs/metrics.md``).

Each line: ``step`` (optimizer step), ``time`` (Unix wall time of the write, s), ``elapsed_s`` (wall time since
the run started, s), ``expert`` (the active expert, or null), then every metric of ``MetricsLogged.values`` as a
field named after the metric (``train/loss``, ``memory/vram_peak_gb``, ...). Non-finite values (NaN, inf) are
written as ``null`` so that every line is strict JSON. A metric named like a reserved field is not written (one
warning).

Resume: at ``RunStarted`` the file keeps only lines with ``step <= RunStarted.step`` (a fresh run, step 0, starts
an empty file), so a resumed run never shows the discarded steps twice. A truncated last line (a killed run) is
dropped there too. Each line is flushed when written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import MetricsLogged, RunStarted
from wantrain.core.events.log import cut_back
from wantrain.core.rundir import open_append

log = structlog.get_logger("wantrain.observers.jsonl_metrics")

RESERVED_FIELDS = ("step", "time", "elapsed_s", "expert")
def _parse(line: str) -> dict[str, Any] | None:
    """One metrics line as a dict, or None for a blank, truncated or foreign line."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if isinstance(record, dict) and isinstance(record.get("step"), int):
        return record
    return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The parsed lines of a metrics file, skipping blank and unparseable (truncated) lines."""
    with open(path, encoding="utf-8") as f:
        return [r for r in map(_parse, f) if r is not None]


class JsonlMetrics(Observer):
    """Appends every ``MetricsLogged`` to ``path`` as one JSON line. A passive sink."""

    priority = Priority.SINK
    replayable = True  # from MetricsLogged and the other events alone

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = None
        self._warned: set[str] = set()

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self._close_file()
        self._truncate_after(event.step)

    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx) -> None:
        record: dict[str, Any] = {
            "step": event.step, "time": time.time(), "elapsed_s": event.elapsed_s, "expert": event.expert,
        }
        values = event.values
        if not values.keys().isdisjoint(RESERVED_FIELDS):
            for name in RESERVED_FIELDS:
                if name in values and name not in self._warned:
                    self._warned.add(name)
                    log.warning("metric_name_reserved", metric=name, reserved=RESERVED_FIELDS, path=str(self.path))
            values = {name: value for name, value in values.items() if name not in RESERVED_FIELDS}
        record.update(values)
        f = self._open()
        # orjson writes NaN and infinities as null; `default` turns other number types (numpy's) into floats
        f.write(orjson.dumps(record, default=float, option=orjson.OPT_APPEND_NEWLINE))
        f.flush()

    def close(self) -> None:
        self._close_file()

    def _open(self) -> IO[bytes]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open_append(self.path)  # held across events; never through a symbolic link
        return self._file

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _truncate_after(self, step: int) -> None:
        cut_back(self.path, step)
