"""TensorBoard event files: every metric of every log step, plus the run's hyperparameters.

Each ``MetricsLogged`` value is one scalar, tagged with its metric name (``train/loss``, ``train/lr``,
``memory/vram_peak_gb``, ...) at the event's optimizer step. ``hparams`` (the flattened run config, see
:func:`flatten_hparams`) go to the HParams plugin of the same run directory -- session start at ``RunStarted``,
session end (with the run's status) at ``RunEnded`` -- with ``train/loss`` as the metric they are compared by.

Cost: each log step's values go into ONE ``Summary`` (one event record, one protobuf serialisation) instead of
one event per scalar; TensorBoard reads every value of it as its own scalar series. The record is written on the
training thread into a buffered file (tensorboardX's ``EventsWriter``), flushed every ``flush_secs`` (checked at
log steps), at ``RunEnded`` and at close: tensorboardX's ``SummaryWriter`` instead pickles every event into a
``multiprocessing.Queue`` drained by a writer thread, which cost more on the training thread than the write
itself (measured: ``bench/bench_overhead.py``). Tags are cleaned once per name (tensorboardX's rule: characters
outside ``[-/\\w.]`` become ``_``).

Resume: the writer is opened at ``RunStarted``; when the run resumes after step N, TensorBoard is told to purge
events with step > N from older files (``purge_step``), so a resumed curve does not fold back on itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.api_pb2 import Status
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboardX.summary import hparams as hparams_summaries

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import MetricsLogged, RunEnded, RunStarted

HPARAM_METRICS = ("train/loss",)
_INVALID_TAG_CHARACTERS = re.compile(r"[^-/\w\.]")
_END_STATUS = {"completed": "STATUS_SUCCESS", "stopped": "STATUS_SUCCESS", "aborted": "STATUS_FAILURE",
               "failed": "STATUS_FAILURE"}


def flatten_hparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}``. Nested mappings (and attrs instances) are joined
    with dots; bools, ints, floats and strings are kept; None becomes ``"none"``; anything else (lists, paths)
    its ``str``."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if attrs.has(type(value)):
            value = attrs.asdict(value, recurse=False)
        if isinstance(value, Mapping):
            flat.update(flatten_hparams(value, prefix=f"{name}."))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        elif value is None:
            flat[name] = "none"
        else:
            flat[name] = str(value)
    return flat


class TensorBoardWriter(Observer):
    """Writes every logged metric (and ``hparams``) to TensorBoard event files in ``log_dir``. A passive sink."""

    priority = Priority.SINK
    replayable = True  # from MetricsLogged and the other events alone

    def __init__(self, log_dir: Path, hparams: dict | None = None, *, flush_secs: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.hparams = flatten_hparams(hparams) if hparams else {}
        self.flush_secs = flush_secs
        self._writer: EventsWriter | None = None
        self._flushed_at = 0.0
        self._session_open = False
        self._tags: dict[str, str] = {}  # metric name -> cleaned tag

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self._close_writer()
        self._open(purge_step=event.step + 1 if event.step > 0 else None)
        if self.hparams:
            exp, session_start, _ = hparams_summaries(self.hparams, dict.fromkeys(HPARAM_METRICS, 0.0))
            self._write(exp, None)
            self._write(session_start, None)
            self._session_open = True

    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx) -> None:
        tags = self._tags
        values = []
        for name, value in event.values.items():
            tag = tags.get(name)
            if tag is None:
                tag = tags[name] = _INVALID_TAG_CHARACTERS.sub("_", name).lstrip("/")
            values.append(Summary.Value(tag=tag, simple_value=float(value)))
        if values:
            self._write(Summary(value=values), event.step)
        if time.monotonic() - self._flushed_at >= self.flush_secs:
            self._flush()  # RunEnded and close() flush the rest

    @on(RunEnded)
    def on_run_ended(self, event: RunEnded, ctx) -> None:
        if self._session_open and self._writer is not None:
            self._write(_session_end(_END_STATUS.get(event.status, "STATUS_UNKNOWN")), None)
            self._session_open = False
        self._flush()

    def close(self) -> None:
        self._close_writer()

    def _open(self, purge_step: int | None = None) -> EventsWriter:
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # tensorboardX names files by the second; a second writer in the same second (a quick resume, tests)
            # would truncate the first. A fixed-width nanosecond suffix keeps names unique and in time order.
            self._writer = EventsWriter(str(self.log_dir / "events"), f".{time.time_ns():020d}")
            self._flushed_at = time.monotonic()
            if purge_step is not None:  # what SummaryWriter(purge_step=...) writes: TensorBoard drops later steps
                self._writer.write_event(Event(step=purge_step, wall_time=time.time(),
                                               session_log=SessionLog(status=SessionLog.START)))
        return self._writer

    def _write(self, summary: Summary, step: int | None) -> None:
        event = Event(summary=summary, wall_time=time.time())
        if step is not None:
            event.step = step
        self._open().write_event(event)

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._flushed_at = time.monotonic()

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()  # flushes
            self._writer = None


def _session_end(status: str) -> Summary:
    """The HParams plugin's session-end summary with ``status`` (tensorboardX always writes success)."""
    content = HParamsPluginData(session_end_info=SessionEndInfo(status=Status.Value(status)), version=0)
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
    )
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)])
