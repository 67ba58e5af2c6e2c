"""The run's request inbox: how a person asks a running run to save, sample, validate or stop.

``<run_dir>/inbox.jsonl`` holds one JSON object per line, appended by ``wantrain ctl`` or the page of
``wantrain serve`` (:func:`post_request`)::

    {"action": "save", "source": "ctl", "id": "3f2a...", "time": 1796154262.9}

The core reads it at one fixed point, after each optimizer step's events and before its saves (see the pseudocode
in ``wantrain.core.events``), and only every :data:`CHECK_EVERY_S` seconds: on other steps the check is one clock
read; on a due step one ``os.stat`` of the file, and bytes are read only when it grew. No device is touched. Each
request becomes a ``ControlRequested`` event in the event log, so a replay shows it, and the core then acts on it:

* ``save``: ``control.request_save`` -- a LoRA save with a checkpoint after this step;
* ``stop``: ``control.request_stop`` -- the run saves and ends ``stopped``, resumable;
* ``sample`` / ``validate``: the event alone; the sample and validation observers run a round at this step.

Requests written before the run started (a previous run of the same directory, a resume) are not for this run:
reading starts at the file's size when the run starts. Only whole lines count (a line being written is read at the
next check); a line that is not a request (bad JSON, an unknown action, a line over :data:`MAX_LINE` bytes or
nested deeper than :data:`MAX_DEPTH`, both checked before parsing) is skipped and logged by the caller: no line can
end the run.
The file is opened without following symbolic links, for reading and for writing.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import attrs

INBOX_NAME = "inbox.jsonl"
ACTIONS = ("save", "sample", "validate", "stop")
CHECK_EVERY_S = 0.2
"""Seconds between two looks at the inbox: a request is acted on at the first step that ends after this."""
_MAX_READ = 1 << 20  # bytes read per look: a runaway writer cannot make one step read a huge file
MAX_LINE = 4096
"""Bytes in one request line (a request is about 100): a longer line is skipped unparsed."""
MAX_DEPTH = 4
"""JSON nesting one request line may have (a request is one flat object): deeper is skipped unparsed, so a line
like ``[[[[...`` cannot reach the parser's recursion."""


@attrs.frozen
class Request:
    """One request of the inbox. ``error`` is set for a line that is not a valid request (then ``action`` may be
    anything)."""

    action: str
    source: str
    request_id: str
    error: str | None = None


def post_request(run_dir: Path, action: str, source: str) -> str:
    """Append a request for ``action`` (one of :data:`ACTIONS`) to ``run_dir``'s inbox; returns its id.

    One ``write`` of one line to a file opened with ``O_APPEND``: concurrent writers do not interleave. Raises
    ``ValueError`` for an unknown action and ``OSError`` when the file cannot be written (a symbolic link in its
    place is refused, ``ELOOP``)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown request {action!r}: use one of {', '.join(ACTIONS)}")
    request_id = uuid.uuid4().hex[:12]
    line = json.dumps({"action": action, "source": str(source)[:40], "id": request_id, "time": time.time()})
    fd = os.open(Path(run_dir) / INBOX_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    return request_id


def json_depth(text: bytes) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``text``, brackets inside JSON strings left out."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_line(line: bytes) -> Request:
    """The request of one inbox line (without its newline); never raises: a line that is not a request comes back
    with ``error`` set."""
    if len(line) > MAX_LINE:
        return Request(action="", source="", request_id="", error=f"a line of {len(line)} bytes (at most {MAX_LINE})")
    if json_depth(line) > MAX_DEPTH:
        return Request(action="", source="", request_id="", error=f"nested deeper than {MAX_DEPTH} levels")
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return Request(action="", source="", request_id="", error="not JSON")
    if not isinstance(record, dict):
        return Request(action="", source="", request_id="", error="not a JSON object")
    action, source, request_id = record.get("action"), record.get("source", ""), record.get("id", "")
    request = Request(action=str(action), source=str(source)[:40], request_id=str(request_id)[:40])
    if action not in ACTIONS:
        return attrs.evolve(request, error=f"unknown action {action!r} (valid: {', '.join(ACTIONS)})")
    return request


class Inbox:
    """Reads the new whole lines of ``<run_dir>/inbox.jsonl``, at most every ``every_s`` seconds of ``clock``."""

    def __init__(self, run_dir: Path, *, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(run_dir) / INBOX_NAME
        self.every_s, self.clock = CHECK_EVERY_S if every_s is None else every_s, clock
        self._next_check = clock() + self.every_s
        self._offset = self._size()  # earlier requests are not for this run

    def _size(self) -> int:
        try:
            return os.stat(self.path, follow_symlinks=False).st_size
        except OSError:
            return 0

    def poll(self) -> list[Request]:
        """The requests written since the last call that found any (empty between checks)."""
        now = self.clock()
        if now < self._next_check:
            return []
        self._next_check = now + self.every_s
        size = self._size()
        if size < self._offset:  # the file was replaced by a shorter one: read it from its start
            self._offset = 0
        if size == self._offset:
            return []
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return []
        try:
            data = os.pread(fd, min(size - self._offset, _MAX_READ), self._offset)
        finally:
            os.close(fd)
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) == _MAX_READ:  # no line end in a whole read: not a request, skip it
                self._offset += len(data)
            return []  # else a line still being written
        self._offset += end + 1
        return [parse_line(line) for line in data[:end].split(b"\n") if line.strip()]
