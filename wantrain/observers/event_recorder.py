"""Records every event to ``<run_dir>/events.jsonl`` (one JSON record per line, schema-versioned, sequenced), or
to ``events.jsonl.gz`` with ``observers.record_compression = "gzip"``.

It is a bus *journal*: it sees each event before any handler (write-ahead), so an event that crashes an observer
is still on record. Records are flushed at every optimizer step (``OptimizerStepped``), log step, save and event
of an observer's own type, and at the end of the run, so a killed run loses at most the records of the step it was
in (possibly a torn last line, which readers skip). A gzip log is
flushed with ``Z_SYNC_FLUSH`` at the same points: everything up to the last flush decompresses from a killed
run's file. On resume the log is cut back to the checkpoint's step (``keep_through_step``) before recording goes
on; a gzip log is rewritten as one member and later records are appended as further members.

Size (tiny model, two experts, grad_accum 1; docs/benchmarks.md): about 1.1 kB per optimizer step as plain JSONL,
about 160 bytes gzip-compressed. Reading: :func:`wantrain.replay.read`.

Cost per event: the core's ``to_record`` and one JSON encoding with ``orjson`` (about 0.3 us for a per-step record,
17x cheaper than the ``json`` module, whose key escaping and float formatting made the recorder the largest
per-step cost of a default run: docs/benchmarks.md). ``orjson`` writes NaN and infinities as ``null``; a record
whose float fields are not all finite (a NaN metric in ``MetricsLogged``) and events of registered types (whose
fields are unknown here) are encoded with the ``json`` module instead, which writes ``NaN``/``Infinity`` as Python's
``json.loads`` reads them back. Flushing at every optimizer step is a write system call per step (issue 12 asks
for it: a killed run keeps every finished step on record).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import attrs
import orjson

from wantrain.core.events import CATALOGUE

EVENT_LOG_NAMES = {"none": "events.jsonl", "gzip": "events.jsonl.gz"}
"""The log's file name in the run directory per ``observers.record_compression``."""

# the end of each optimizer step, each log step and each save; events other than the core's (an observer's own,
# rare: the alpha controller's AlphaChanged) are flushed at once
_NOT_FLUSHED = frozenset(("StepStarted", "LossComputed", "GradsReady", "ExpertSwitched"))


def event_log_path(run_dir: Path, compression: str = "none") -> Path:
    return Path(run_dir) / EVENT_LOG_NAMES[compression]


def find_event_log(run_dir: Path) -> Path | None:
    """The event log of a run directory (plain or gzip), or None when the run recorded none."""
    for name in EVENT_LOG_NAMES.values():
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _float_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if "float" in str(f.type))


# event type name -> the fields that may hold floats (orjson would write a non-finite one as null)
_FLOAT_FIELDS = {cls.__name__: _float_fields(cls) for cls in CATALOGUE}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        value = value.values()
    elif not isinstance(value, tuple | list):
        return True  # int, None
    return all(not isinstance(v, float) or math.isfinite(v) for v in value)


def encode_record(record: dict[str, Any]) -> bytes:
    """One log line (with its newline): orjson where that is exact, the json module otherwise (see above)."""
    floats = _FLOAT_FIELDS.get(record["_type"])  # wall_time is time.time(): finite
    if floats is not None and (not floats or all(_finite(record[name]) for name in floats)):
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
    return (_ENCODE(record) + "\n").encode()


class EventRecorder:
    """``keep_through_step``: on resume, records of later steps (the lost continuation of a killed run) and a
    torn last line are cut away before recording goes on; 0 (a fresh run) starts an empty file. A path ending in
    ``.gz`` is written gzip-compressed."""

    def __init__(self, path: Path, *, keep_through_step: int = 0) -> None:
        self.path = Path(path)
        _cut_back(self.path, keep_through_step)
        self._fh = _open_append(self.path)

    @property
    def name(self) -> str:
        return "EventRecorder"

    def attach_to(self, bus: Any) -> None:
        bus.add_journal(self.write, owner=self)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(encode_record(record))
        if record["_type"] not in _NOT_FLUSHED:
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def _open_append(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        # GzipFile.flush() is a Z_SYNC_FLUSH: a readable prefix at every flush
        return gzip.GzipFile(path, "ab", compresslevel=6)
    return path.open("ab")


def iter_log_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """``(line_number, text, complete)`` for each line of a plain or gzip log, 1-based. ``complete`` is False only
    for a last line without its newline (a crash mid-write). A gzip stream that ends early (a killed run) or is
    damaged ends the iteration there, as a torn tail."""
    pending = b""
    number = 0
    for chunk in _chunks(Path(path)):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            number += 1
            yield number, line.decode("utf-8", errors="replace"), True
    if pending:
        yield number + 1, pending.decode("utf-8", errors="replace"), False


def _chunks(path: Path, size: int = 1 << 16) -> Iterator[bytes]:
    with path.open("rb") as fh:
        if path.suffix != ".gz":
            while chunk := fh.read(size):
                yield chunk
            return
        decompressor = zlib.decompressobj(wbits=31)  # gzip members, one after another
        while raw := fh.read(size):
            while raw:
                before = decompressor.copy()
                try:
                    yield decompressor.decompress(raw)
                except zlib.error:  # damaged (a block cut mid-write): yield what decodes before the damage
                    yield _decodable_prefix(before, raw)
                    return
                if decompressor.eof:
                    raw = decompressor.unused_data
                    decompressor = zlib.decompressobj(wbits=31)
                else:
                    raw = b""


def _decodable_prefix(decompressor: Any, raw: bytes) -> bytes:
    out = []
    for i in range(len(raw)):
        try:
            out.append(decompressor.decompress(raw[i:i + 1]))
        except zlib.error:
            break
    return b"".join(out)


def _cut_back(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for _, line, complete in iter_log_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line of a killed run
        if complete and isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as fh:
            fh.write("".join(kept))
    else:
        tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def read_events(path: Path) -> list[Any]:
    """Events from a recording, as a list (see :func:`wantrain.replay.read`, which this calls)."""
    from wantrain.replay import read

    return list(read(path))
