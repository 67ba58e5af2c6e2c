"""Records every event to ``<run_dir>/events.jsonl`` (one JSON record per line, schema-versioned, sequenced), or
to ``events.jsonl.gz`` with ``observers.record_compression = "gzip"``.

It is a bus *journal*: it sees each event before any handler (write-ahead), so an event that crashes an observer
is still on record. Records are flushed at every optimizer step (``OptimizerStepped``), log step, save and event
of an observer's own type, and at the end of the run, so a killed run loses at most the records of the step it was
in (possibly a torn last line, which readers skip). A gzip log is
flushed with ``Z_SYNC_FLUSH`` at the same points: everything up to the last flush decompresses from a killed
run's file. On resume the log is cut back to the checkpoint's step (``keep_through_step``) before recording goes
on; a gzip log is rewritten as one member and later records are appended as further members. A record left out
there (a ``CheckpointSaved`` already on record) does not leave a gap: the later records of the process are
renumbered, so ``seq`` stays contiguous (``core.events.log.SequenceCheck``).

Size (tiny model, two experts, grad_accum 1; docs/benchmarks.md): about 1.1 kB per optimizer step as plain JSONL,
about 160 bytes gzip-compressed. The format (encoding, torn tails, cutting back, reading):
:mod:`wantrain.core.events.log`.

Cost per event: the core's ``to_record`` and one JSON encoding with ``orjson`` (about 0.3 us for a per-step record,
17x cheaper than the ``json`` module, whose key escaping and float formatting made the recorder the largest
per-step cost of a default run: docs/benchmarks.md). ``orjson`` writes NaN and infinities as ``null``; a record
whose float fields are not all finite (a NaN metric in ``MetricsLogged``) and events of registered types (whose
fields are unknown here) are encoded with the ``json`` module instead, which writes ``NaN``/``Infinity`` as Python's
``json.loads`` reads them back. Flushing at every optimizer step is a write system call per step (issue 12 asks
for it: a killed run keeps every finished step on record).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wantrain.core.events.log import cut_back, encode_record, open_append

# the end of each optimizer step, each log step and each save; events other than the core's (an observer's own,
# rare: the alpha controller's AlphaChanged) are flushed at once
_NOT_FLUSHED = frozenset(("StepStarted", "LossComputed", "GradsReady", "ExpertSwitched"))


class EventRecorder:
    """``keep_through_step``: on resume, records of later steps (the lost continuation of a killed run) and a
    torn last line are cut away before recording goes on; 0 (a fresh run) starts an empty file. A path ending in
    ``.gz`` is written gzip-compressed."""

    def __init__(self, path: Path, *, keep_through_step: int = 0) -> None:
        self.path = Path(path)
        kept = cut_back(self.path, keep_through_step, sequenced=True)
        # A resumed run delivers again a CheckpointSaved a kill may have cut short (core.loop); one already on
        # record (the kill came while observers handled it) is not written twice.
        self._on_record = {(r["step"], r.get("checkpoint")) for r in kept
                           if r.get("_type") == "CheckpointSaved" and r["step"] == keep_through_step}
        self._fh = open_append(self.path)
        self._seq_shift = 0  # records left out (above) so far: later ones are renumbered to keep seq contiguous

    @property
    def name(self) -> str:
        return "EventRecorder"

    def attach_to(self, bus: Any) -> None:
        bus.add_journal(self.write, owner=self)

    def write(self, record: dict[str, Any]) -> None:
        if self._on_record and record["_type"] == "CheckpointSaved":
            key = (record["step"], record.get("checkpoint"))
            if key in self._on_record:
                self._on_record.discard(key)
                self._seq_shift += 1
                return
        if self._seq_shift:
            record = {**record, "seq": record["seq"] - self._seq_shift}
        self._fh.write(encode_record(record))
        if record["_type"] not in _NOT_FLUSHED:
            self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
