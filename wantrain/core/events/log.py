"""The event log's format, in one place: ``<run_dir>/events.jsonl`` (or ``events.jsonl.gz``), one JSON record per
line (``wantrain.core.events.to_record``: the event's fields, ``_type``, ``seq``, ``wall_time``, ``schema``).

* Encode: :func:`encode_record` (orjson where that is exact, the ``json`` module for non-finite floats and events
  of registered types, whose fields are unknown here: ``NaN``/``Infinity`` as Python's ``json.loads`` reads them).
* Append: :func:`open_append` (never through a symbolic link; a gzip log is appended as further members;
  ``GzipFile.flush()`` is a ``Z_SYNC_FLUSH``, so a killed run's file decompresses up to its last flush).
* Cut back to a step: :func:`cut_back` (any JSONL file of step records, plain or gzip: the event log and the
  metrics files on resume).
* Iterate: :func:`iter_log_lines` (plain or gzip, a torn tail marked ``complete=False``).
* Read typed events: :func:`read` / :func:`read_events`.

Robustness of :func:`read`: a torn last line (a crash mid-write) is skipped with a warning; a record of another
schema version stops with one line (:class:`~wantrain.core.errors.UserError`); so does a line that is not JSON
before the last one and a break in the ``seq`` numbering (:class:`SequenceCheck`: a gap, a duplicate or a reorder,
named with its line); a record of an event type this process does not know (a user's own, whose module is not
imported) is skipped with one warning per type. On resume, :func:`cut_back` notices the same damage, keeps the
damaged file beside the log and warns instead of refusing (the checkpoint, not the log, is what a run continues
from).

Written by ``wantrain.observers.event_recorder``; read by ``wantrain.app.replay`` and notebooks::

    from wantrain.core.events.log import read
    for event in read("runs/20261130_101500"):        # a run directory, events.jsonl or events.jsonl.gz
        ...
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import attrs
import cattrs
import orjson
import structlog

from wantrain.core.atomic import atomic_write
from wantrain.core.errors import UserError
from wantrain.core.events import CATALOGUE, SCHEMA_VERSION, Event, from_record, known_event_types
from wantrain.core.rundir import open_append as open_append_no_follow

log = structlog.get_logger("wantrain.replay")  # the name its warnings had when read() lived in replay

EVENT_LOG_NAMES = {"none": "events.jsonl", "gzip": "events.jsonl.gz"}
"""The log's file name in the run directory per ``observers.record_compression``."""



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


class _GzipAppend(gzip.GzipFile):
    """A ``GzipFile`` over a file it was handed, closing that file too."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__(fileobj=raw, mode="ab", compresslevel=6)
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def open_append(path: Path) -> IO[bytes]:
    """The log opened for appending, never through a symbolic link (``core.rundir.open_append``: one line
    instead); a path ending in ``.gz`` is written gzip-compressed."""
    raw = open_append_no_follow(Path(path))
    if Path(path).suffix == ".gz":
        return _GzipAppend(raw)  # GzipFile.flush() is a Z_SYNC_FLUSH: a readable prefix at every flush
    return raw


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


def cut_back(path: Path, step: int, *, sequenced: bool = False) -> list[dict[str, Any]]:
    """Keep only the complete lines of the JSONL file ``path`` (plain or gzip) that are records with an integer
    ``step <= step``, byte for byte, rewritten atomically (``core.atomic.atomic_write``: fsync'ed, a unique
temporary name, a full disk one line); nothing happens when the file does not exist. Resume
    cuts the event log and every metrics file back to the checkpoint's step with it (a torn tail goes too).
    Returns the kept records, parsed.

    Damage is never dropped silently: a complete line that is not JSON (garbage in the middle) and, for the event
    log (``sequenced``), a break in the ``seq`` numbering (:class:`SequenceCheck`: records removed, duplicated or
    reordered) keep the file as it was beside it (``<name>.damaged-<time>``) and log a warning naming the first
    damaged line and the copy; the run goes on with the records that could be read."""
    path = Path(path)
    if not path.exists():
        return []
    kept, records, damage = [], [], None
    sequence = SequenceCheck() if sequenced else None
    for number, line, complete in iter_log_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if complete and line.strip() and damage is None:
                damage = f"line {number} is not JSON"
            continue  # a blank or torn line
        if not complete:
            continue
        if sequence is not None and damage is None:
            problem = sequence.problem(number, record)
            damage = f"line {number}: {problem}" if problem is not None else None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
            records.append(record)
    if damage is not None:
        copy = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d_%H%M%S')}")
        shutil.copy2(path, copy)
        log.warning("damaged_log_kept", path=str(path), problem=damage, copy=str(copy),
                    hint="the run goes on; the damaged records are not in the rewritten log, the copy keeps them")
    text = "".join(kept).encode("utf-8")
    if path.suffix == ".gz":
        def write_gzip(tmp: Path) -> None:
            with gzip.open(tmp, "xb", compresslevel=6) as fh:
                fh.write(text)

        atomic_write(path, write_gzip, what="the run's log")
    else:
        atomic_write(path, text, what="the run's log")
    return records


class SequenceCheck:
    """The ``seq`` numbering of an event log, record by record: the bus numbers every event it dispatches from 1,
    so within one process the numbers go up by one; a resumed run's process starts again at 1 with its
    ``RunStarted`` (``resumed_from`` set). Anything else is damage: a gap (records removed), a number seen again
    (a duplicate) or one going back (a reorder)."""

    def __init__(self) -> None:
        self.previous: int | None = None
        self.previous_line = 0

    def problem(self, number: int, record: Any) -> str | None:
        """What is wrong with the record on line ``number`` after the ones seen so far, or None."""
        seq = record.get("seq") if isinstance(record, dict) else None
        if not isinstance(seq, int) or isinstance(seq, bool):
            return "the record has no sequence number ('seq')"
        previous, self.previous, before = self.previous, seq, self.previous_line
        self.previous_line = number
        expected = 1 if previous is None else previous + 1
        if seq == expected:
            return None
        if seq == 1 and record.get("_type") == "RunStarted" and record.get("resumed_from"):
            return None  # a resumed run's first record
        if previous is None:
            return f"the log starts at seq {seq}, not 1 (records are missing before it)"
        if seq > expected:
            return (f"seq jumps from {previous} (line {before}) to {seq}: {seq - expected} record(s) are missing "
                    "there")
        if seq == previous:
            return f"seq {seq} repeats line {before} (a duplicated record)"
        return f"seq {seq} comes after seq {previous} (line {before}): the records are out of order"


def read(path: str | Path, *, until: int | None = None) -> Iterator[Event]:
    """Yield the typed events of an event log (a run directory, ``events.jsonl`` or ``events.jsonl.gz``), in the
    order they were dispatched; ``until``: stop after the events of that optimizer step."""
    path = resolve_event_log(Path(path))
    unknown: dict[str, int] = {}
    known = {t.__name__ for t in known_event_types()}
    sequence = SequenceCheck()
    for number, line, complete in iter_log_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if not complete:
                log.warning("torn_last_line_skipped", path=str(path), line=number)
                break
            raise UserError(f"event log '{path}' line {number} is not JSON; the log is damaged") from None
        if not complete:  # valid JSON but the newline never made it: the writer died before finishing the record
            log.warning("torn_last_line_skipped", path=str(path), line=number)
            break
        if not isinstance(record, dict) or "_type" not in record:
            raise UserError(f"event log '{path}' line {number} is not an event record (no '_type')")
        if record.get("schema") != SCHEMA_VERSION:
            raise UserError(
                f"event log '{path}' has schema version {record.get('schema')!r} (line {number}); this wantrain "
                f"reads version {SCHEMA_VERSION}: replay it with the wantrain version that recorded it"
            )
        problem = sequence.problem(number, record)
        if problem is not None:
            raise UserError(f"event log '{path}' line {number}: {problem}; the log is damaged (records removed, "
                            "duplicated or reordered since it was written)")
        kind = record["_type"]
        if kind not in known:
            if kind not in unknown:
                log.warning("unknown_event_type_skipped", event_type=kind, path=str(path), line=number,
                            hint="an observer's own event: import the module that registers it to read it")
            unknown[kind] = unknown.get(kind, 0) + 1
            continue
        if until is not None and record.get("step", 0) > until:
            break
        try:
            event = from_record(record)
        except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:  # fields do not fit the class
            raise UserError(f"event log '{path}' line {number}: a {kind} record does not fit its event class "
                            f"({type(exc).__name__}: {exc})") from None
        yield event
    for kind, count in unknown.items():
        if count > 1:
            log.warning("unknown_event_type_skipped_total", event_type=kind, records=count)


def resolve_event_log(path: Path) -> Path:
    """The event log ``path`` names: a run directory (its log, plain or gzip) or the log file itself."""
    if path.is_dir():
        found = find_event_log(path)
        if found is None:
            raise UserError(
                f"'{path}' holds no event log ({' or '.join(EVENT_LOG_NAMES.values())}); the run was trained with "
                "observers.record_events = false"
            )
        return found
    if not path.is_file():
        raise UserError(f"event log '{path}' does not exist (pass a run directory or its events.jsonl[.gz])")
    return path


def read_events(path: Path) -> list[Event]:
    """The typed events of a recording, as a list (:func:`read`)."""
    return list(read(path))
