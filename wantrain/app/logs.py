"""structlog configuration for a run: a human-readable console and a JSON-lines file in the run directory.

Both go through stdlib ``logging`` handlers on the ``wantrain`` logger (two renderers for one event stream);
wantrain logs a handful of lines per run, so the cost of the stdlib route does not matter here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

import structlog

from wantrain.core.atomic import is_storage_error, storage_error
from wantrain.core.readable import shown
from wantrain.core.rundir import open_append

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]

# Events written to log.jsonl but not to the console: routine, frequent, and shown by the progress line anyway
# (``expert_switched`` comes every ``model.switch_every`` steps; the progress line names the expert).
FILE_ONLY = frozenset({"expert_switched"})


def _not_file_only(record: logging.LogRecord) -> bool:
    event = record.msg.get("event") if isinstance(record.msg, dict) else None
    return event not in FILE_ONLY


def _readable(_logger: object, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """The console's values as a person reads them (``wantrain.core.readable``): ``run_dir=runs/2026...``,
    ``loss=1.609``; the JSON file keeps them whole."""
    return {k: v if k in ("event", "timestamp", "level", "logger") else shown(v) for k, v in event_dict.items()}


def configure_logging(log_file: Path | None = None, *, level: int = logging.INFO) -> logging.Handler | None:
    """Send wantrain's logs to stderr (readable) and, if given, ``log_file`` (one JSON object per line).

    Returns the file handler so the caller can close it at the end of the run (:func:`close_log_file`).
    """
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger("wantrain")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    root.propagate = False

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _readable,
            structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
            ),
        ],
    ))
    console.addFilter(_not_file_only)
    root.addHandler(console)

    file_handler = None
    if log_file is not None:
        file_handler = _NoFollowFileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.dict_tracebacks,
                structlog.processors.JSONRenderer(),
            ],
        ))
        root.addHandler(file_handler)
    return file_handler


class _NoFollowFileHandler(logging.FileHandler):
    """A ``FileHandler`` that never appends through a symbolic link (``core.rundir.open_append``).

    A full disk or a run directory gone read-only (``core.atomic.is_storage_error``) stops the file's log: one line
    on stderr naming the file and the free space, once, instead of logging's "--- Logging error ---" and a
    traceback for every later record. The console log goes on; the run itself ends at its next write (one line,
    exit code 2).
    """

    def _open(self):  # type: ignore[override]
        return open_append(Path(self.baseFilename), text=True, encoding=self.encoding or "utf-8")

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if exc is None or not is_storage_error(exc):
            super().handleError(record)
            return
        print(f"wantrain: {storage_error('the run log', self.baseFilename, exc, hint='the run log stops here')}",
              file=sys.stderr)
        logging.getLogger("wantrain").removeHandler(self)
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()  # its buffer cannot be written either: dropped

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(logging.makeLogRecord({}))  # close() flushes: the same one line, not a traceback


def close_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger("wantrain").removeHandler(handler)
        handler.close()  # a full disk: one line (_NoFollowFileHandler.handleError), never raised
