"""What ``wantrain serve`` shows of a run, read from its run directory alone (no database that can disagree).

Files read (each is what the run itself writes; none is required):

* ``events.jsonl`` -- the event log: the run's start (total steps), its end (status), and the timeline (every event
  except the per-step ones: ``StepStarted``, ``LossComputed``, ``GradsReady``, ``OptimizerStepped`` unless skipped,
  and ``MetricsLogged``, whose values are the charts');
* ``metrics.jsonl`` -- one line per log step: the series of every metric (``train/loss/<expert>``, ``train/lr/*``,
  ``alpha/*``, norms, ``memory/*``, ``val/*``);
* ``log.jsonl`` -- warnings and errors of the run log join the timeline;
* ``config.toml``, ``preflight.json``, ``lr_finder.json`` / ``lr_finder.csv``, ``samples/``, ``checkpoints/``.

JSONL files are read incrementally (:class:`JsonlTail`: a byte offset, only new whole lines are parsed; a gzip log
as a stream, :class:`GzipJsonlTail`), and the metrics go into columns that grow without copying, so a poll of a
large run costs what was written since the last one. A log rewritten by a resume is recognised
(:meth:`JsonlTail.rewritten`) and the run read again from the start (``RunData.generation`` counts it). A torn last
line (a run killed mid-write) is left unread and reported; a line that is not JSON is counted and skipped.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import operator
import os
import re
import stat
import threading
import time
import tomllib
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from wantrain.app.keep import pick_step
from wantrain.core.events import ControlRequested
from wantrain.core.events.log import iter_log_lines
from wantrain.core.inbox import ACTIONS, post_request
from wantrain.core.rundir import is_safe_name
from wantrain.data.report import memory_lines
from wantrain.observers.jsonl_metrics import read_metrics

__all__ = ["ACTIONS", "RunData", "RunGone", "ask", "downsample", "list_runs", "resolve_file", "resolve_run"]

STALE_S = 900.0
"""A run without ``RunEnded`` whose files have not changed for this long is shown ``interrupted``, not running."""
_TIMELINE_TYPE = re.compile(rb'"_type": ?"(?!(?:StepStarted|LossComputed|GradsReady|OptimizerStepped|MetricsLogged)")')
_SKIPPED = re.compile(rb'"skipped": ?true')
_SAMPLE = re.compile(r"step_(\d+)_(\d+)(_latents)?\.(mp4|png)$")
_WARNING = re.compile(rb'"level": ?"(?:warning|error|critical)"')
_NOT_METRICS = {"step", "time", "elapsed_s", "expert"}
_MAX_READ = 256 << 20  # bytes read per call (a refresh reads on until the end of the file)
_HEAD = 4096  # bytes at the start of a log that must stay the same for the reader to go on where it stopped


class RunGone(Exception):
    """The run directory does not exist (any more) or is not a run of this output directory."""


def resolve_run(root: Path, name: str) -> Path:
    """``root/name`` when ``name`` is one safe path component naming a directory inside ``root`` (after links are
    resolved); else :class:`RunGone`."""
    if not is_safe_name(name):
        raise RunGone(f"{name!r} is not a run name")
    path = root / name
    try:
        real = path.resolve(strict=True)
    except OSError:
        raise RunGone(f"no run {name!r} in {root}") from None
    if real.parent != root.resolve() or not real.is_dir():
        raise RunGone(f"{name!r} is not a run directory of {root}")
    return real


def resolve_file(run_dir: Path, relative: str) -> Path:
    """A file inside ``run_dir`` named by ``relative`` (``samples/step_000200_00.mp4``): no absolute path, no
    ``..``, and after links are resolved still inside ``run_dir``; else :class:`RunGone`."""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise RunGone(f"{relative!r} is not a file of the run")
    try:
        real = (run_dir / relative).resolve(strict=True)
    except OSError:
        raise RunGone(f"no file {relative!r} in the run") from None
    if not real.is_relative_to(run_dir.resolve()) or not real.is_file():
        raise RunGone(f"{relative!r} is not a file of the run")
    return real


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ("events.jsonl", "events.jsonl.gz", "config.toml"))


class JsonlTail:
    """The whole lines appended to a JSONL file since the last :meth:`read`, parsed. ``select(buffer)``, when given,
    picks the lines worth parsing out of a buffer of whole lines in C-speed scans (a regex over the buffer), so a
    500k-line event log is not split line by line.

    A resume rewrites the file shorter (``core.events.log.cut_back``, a new file renamed over the old one) and the
    run then appends to it again, possibly past the old size before the next look: :meth:`rewritten` tells, from
    the file's identity (device and inode), its size and its first bytes, and the reader is then rebuilt."""

    def __init__(self, path: Path, select: Any = None) -> None:
        self.path, self.select = path, select
        self.offset = 0  # bytes of the file consumed
        self.bad_lines = 0
        self.torn_tail = 0  # bytes after the last newline
        self.more = False  # the last read stopped at _MAX_READ
        self.bytes_read = 0  # bytes read from the file, all reads together (bench/bench_serve.py, the tests)
        self._identity: tuple[int, int] | None = None
        self._head = b""  # the first _HEAD bytes consumed, to recognise the same file
        self._pending = b""  # text after the last newline (a line being written)

    def rewritten(self) -> bool:
        """Whether the file read so far was replaced, cut shorter or changed at its start (a resume's rewrite)."""
        if self._identity is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return True  # gone, or a link now
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != self._identity or info.st_size < self.offset:
                return True
            return os.pread(fd, len(self._head), 0) != self._head
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return []
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return []
            self._identity = (info.st_dev, info.st_ino)
            size = info.st_size
            raw = os.pread(fd, min(size - self.offset, _MAX_READ), self.offset) if size > self.offset else b""
            if raw and len(self._head) < _HEAD:
                self._head = os.pread(fd, min(_HEAD, self.offset + len(raw)), 0)
        finally:
            os.close(fd)
        self.offset += len(raw)
        self.bytes_read += len(raw)
        self.more = size > self.offset
        if not raw:
            return []
        text = self._pending + self._decode(raw)
        end = text.rfind(b"\n")
        self._pending = text[end + 1:]
        self.torn_tail = len(self._pending)
        return self._parse(text[:end + 1]) if end >= 0 else []

    def _decode(self, raw: bytes) -> bytes:
        return raw

    def _parse(self, whole: bytes) -> list[dict[str, Any]]:
        """The records of ``whole`` (whole lines) that ``select`` picks."""
        if self.select is not None:
            lines = self.select(whole)
            array = b"[" + b",".join(lines) + b"]"
        else:  # every line: the buffer itself becomes one JSON array (one C pass, no line objects)
            lines = None
            array = b"[" + whole[:-1].replace(b"\n", b",") + b"]"
        try:  # one parse of all lines as a JSON array: no per-line call
            records = orjson.loads(array) if array != b"[]" else []
        except orjson.JSONDecodeError:
            records = []
            if lines is None:
                lines = whole.split(b"\n")
            for line in filter(bytes.strip, lines):  # a bad line among them: one by one, count what fails
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError:
                    self.bad_lines += 1
        out = [r for r in records if isinstance(r, dict)]
        self.bad_lines += len(records) - len(out)
        return out


class GzipJsonlTail(JsonlTail):
    """The same for a gzip-compressed log (``events.jsonl.gz``, ``observers.record_compression = "gzip"``), read
    as a stream from where it stopped: the compressed bytes appended since the last read go into the same
    decompressor (gzip members one after another, as the recorder appends them; a member still being written is
    decompressed as far as its bytes go), so a poll costs what was written since the last one, however long the
    run. Damaged bytes (not a gzip stream) end the reading there, said as a problem."""

    def __init__(self, path: Path, select: Any = None) -> None:
        super().__init__(path, select)
        self._stream = zlib.decompressobj(wbits=31)
        self.damaged_at: int | None = None  # the compressed offset of the damage

    def _decode(self, raw: bytes) -> bytes:
        out = []
        start = self.offset - len(raw)
        while raw and self.damaged_at is None:
            try:
                out.append(self._stream.decompress(raw))
            except zlib.error:
                self.damaged_at = start
                break
            if self._stream.eof:  # one member ended: the next one starts in its unused data
                raw = self._stream.unused_data
                start = self.offset - len(raw)
                self._stream = zlib.decompressobj(wbits=31)
            else:
                raw = b""
        return b"".join(out)


def _lines_at(data: bytes, positions: Any) -> list[bytes]:
    """The lines of ``data`` (whole lines) holding the byte ``positions``, in file order, each once."""
    starts = sorted({data.rfind(b"\n", 0, pos) + 1 for pos in positions})
    return [data[start:data.find(b"\n", start)] for start in starts]


def _timeline_lines(data: bytes) -> list[bytes]:
    """Event-log lines for the timeline: the ``_type`` of any event but the per-step ones and ``MetricsLogged``,
    and the skipped optimizer steps."""
    found = [m.start() for m in _TIMELINE_TYPE.finditer(data)]
    found += [m.start() for m in _SKIPPED.finditer(data)]
    return _lines_at(data, found)


def _warning_lines(data: bytes) -> list[bytes]:
    return _lines_at(data, [m.start() for m in _WARNING.finditer(data)])


class RunData:
    """A run directory as the page sees it, refreshed incrementally by :meth:`refresh`. ``generation`` counts the
    rebuilds after a log was rewritten (a resume): the page reloads the run when it changes. ``lock`` is held by
    whoever refreshes or reads it (the server's handlers run in threads)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.name = run_dir.name
        self.generation = 0
        self.lock = threading.Lock()
        self.last_summary: dict[str, Any] | None = None  # what the runs list shows while another thread reads
        self._start()

    def _start(self) -> None:
        """Empty columns and timeline, and readers at the start of each file."""
        run_dir = self.run_dir
        self._metrics = JsonlTail(run_dir / "metrics.jsonl")
        self._events = (GzipJsonlTail(run_dir / "events.jsonl.gz", select=_timeline_lines) if self._gzip_log()
                        else JsonlTail(run_dir / "events.jsonl", select=_timeline_lines))
        self._log = JsonlTail(run_dir / "log.jsonl", select=_warning_lines)
        # metrics as columns: the step of each row, one float array per metric (NaN where a row lacks it)
        self._rows = 0
        self._steps = np.zeros(0)  # buffers with room to grow (doubling): appending a row copies nothing
        self._columns: dict[str, np.ndarray] = {}
        self.timeline: list[dict[str, Any]] = []
        self.switches: list[int] = []  # steps of ExpertSwitched
        self.started: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None
        self.last_row: dict[str, Any] = {}
        self.last_loss: float | None = None
        self.first_elapsed: tuple[int, float] | None = None  # (step, elapsed_s) of the first train row

    def _gzip_log(self) -> bool:
        return not (self.run_dir / "events.jsonl").exists() and (self.run_dir / "events.jsonl.gz").exists()

    @property
    def tails(self) -> tuple[JsonlTail, ...]:
        return self._metrics, self._events, self._log

    def refresh(self) -> None:
        if not self.run_dir.is_dir():
            raise RunGone(f"the run directory {self.run_dir} no longer exists")
        if (any(tail.rewritten() for tail in self.tails)
                or isinstance(self._events, GzipJsonlTail) != self._gzip_log()):
            self._start()  # a resume cut the logs back: read them again from their start
            self.generation += 1
        while True:
            self._read_once()
            if not any(tail.more for tail in self.tails):
                break

    def _read_once(self) -> None:
        self._add_rows(self._metrics.read())
        for record in self._events.read():
            kind = record.get("_type")
            if kind == "RunStarted":
                self.started = record
                self.ended = None  # a resumed run in the same directory
            elif kind == "RunEnded":
                self.ended = record
            elif kind == "ExpertSwitched" and isinstance(record.get("step"), int):
                self.switches.append(record["step"])
            self.timeline.append(_timeline_item(record))
        for record in self._log.read():
            self.timeline.append({"type": f"log: {record.get('event', '?')}", "step": record.get("step"),
                                  "time": _iso_time(record.get("timestamp")), "level": record.get("level"),
                                  "detail": {k: v for k, v in record.items()
                                             if k not in ("event", "level", "timestamp", "logger")}})

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def steps(self) -> np.ndarray:
        return self._steps[:self._rows]

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """One float array per metric, NaN where a row lacks it (views: later rows go past their end)."""
        return {key: column[:self._rows] for key, column in self._columns.items()}

    def _room(self, count: int) -> None:
        """Capacity for ``count`` more rows: the buffers double when full, so rows cost O(1) each, amortised (a
        poll of a 100k-row run copies nothing)."""
        need = self._rows + count
        if need <= len(self._steps):
            return
        capacity = max(need, 2 * len(self._steps), 1024)
        for key, column in self._columns.items():
            grown = np.full(capacity, np.nan)
            grown[:self._rows] = column[:self._rows]
            self._columns[key] = grown
        steps = np.zeros(capacity)
        steps[:self._rows] = self._steps[:self._rows]
        self._steps = steps

    def _add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Append metrics rows to the columns. Rows with the same keys (most of them) become one 2-D array in one
        numpy call, so a 100k-row file costs a few Python operations per row, not one per value."""
        good = [r for r in rows if type(r.get("step")) in (int, float)]
        self._metrics.bad_lines += len(rows) - len(good)
        if not good:
            return
        count = len(good)
        groups: dict[tuple[str, ...], list[int]] = {}
        for index, keys in enumerate(map(tuple, good)):
            groups.setdefault(keys, []).append(index)
        batch: dict[str, np.ndarray] = {}
        for keys, indices in groups.items():
            names = [k for k in keys if k not in _NOT_METRICS]
            if not names:
                continue
            pick = operator.itemgetter(*names) if len(names) > 1 else (lambda r, k=names[0]: (r[k],))
            members = [good[i] for i in indices] if len(indices) < count else good
            try:  # the fast path: every value a number or null (null -> NaN)
                table = np.array(list(map(pick, members)), dtype=np.float64).reshape(len(indices), -1)
            except (TypeError, ValueError):  # a value that is not a number: that metric's points are NaN
                table = np.array([[v if type(v) in (int, float) else None for v in pick(r)] for r in members],
                                 dtype=np.float64).reshape(len(indices), -1)
            for j, key in enumerate(names):
                column = batch.get(key)
                if column is None:
                    column = batch[key] = np.full(count, np.nan)
                column[indices] = table[:, j]
        self._room(count)
        start, end = self._rows, self._rows + count
        for key, values in batch.items():
            column = self._columns.get(key)
            if column is None:  # a metric first seen now: NaN for the rows before (and the room after)
                column = self._columns[key] = np.full(len(self._steps), np.nan)
            column[start:end] = values
        self._steps[start:end] = [float(r["step"]) for r in good]
        self._rows = end
        for row in reversed(good):
            if "train/loss" in row:
                self.last_loss, self.last_row = row["train/loss"], row
                break
        if self.first_elapsed is None:
            first = next((r for r in good if "train/loss" in r), None)
            if first is not None:
                self.first_elapsed = (int(first["step"]), float(first.get("elapsed_s", 0.0)))

    # -- what the page asks for -----------------------------------------------------------------------------------
    def status(self) -> str:
        if self.ended is not None:
            return str(self.ended.get("status", "ended"))
        if self.started is None and not self._events.path.exists():
            return "preparing" if self.age() < STALE_S else "interrupted"
        return "running" if self.age() < STALE_S else "interrupted"

    def age(self) -> float:
        """Seconds since the run last wrote one of its logs."""
        times = []
        for name in ("events.jsonl", "events.jsonl.gz", "metrics.jsonl", "log.jsonl"):
            with contextlib.suppress(OSError):
                times.append(os.stat(self.run_dir / name).st_mtime)
        return time.time() - max(times) if times else math.inf

    def summary(self) -> dict[str, Any]:
        status = self.status()
        step = int(self.last_row.get("step", self.started.get("step", 0) if self.started else 0))
        if self.ended is not None:
            step = int(self.ended.get("step", step))
        total = self.started.get("total_steps") if self.started else None
        eta = None
        if status == "running" and total and self.first_elapsed and self.last_row:
            done = step - self.first_elapsed[0]
            seconds = float(self.last_row.get("elapsed_s", 0.0)) - self.first_elapsed[1]
            if done > 0 and seconds > 0:
                eta = (total - step) * seconds / done
        return {
            "id": self.name, "name": self.run_name(), "status": status, "step": step, "total_steps": total,
            "last_loss": self.last_loss, "eta_s": eta, "age_s": _finite(self.age()),
            "kind": "lr_finder" if (self.run_dir / "lr_finder.json").exists() or self.name.endswith("__lr_finder")
            else "train",
            "experts": self.started.get("experts") if self.started else None,
            "reason": self.ended.get("reason") if self.ended else None,
            "problems": self.problems(),
        }

    def config(self) -> dict[str, Any]:
        try:
            return tomllib.loads((self.run_dir / "config.toml").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def run_name(self) -> str | None:
        return (self.config().get("run") or {}).get("name")

    def sample_prompts(self) -> list[str]:
        """``[sample] prompts`` of the run's config (the text of each sample row), as the run resolved them."""
        prompts = (self.config().get("sample") or {}).get("prompts")
        return [str(p) for p in prompts] if isinstance(prompts, list) else []

    def problems(self) -> list[str]:
        out = []
        for tail in (self._events, self._metrics):
            if tail.bad_lines:
                out.append(f"{tail.path.name}: {tail.bad_lines} line(s) are not JSON and were skipped")
            damaged = getattr(tail, "damaged_at", None)
            if damaged is not None:
                out.append(f"{tail.path.name}: damaged at byte {damaged} (not a gzip stream from there); what "
                           "follows is not shown")
            if tail.torn_tail and (self.ended is not None or self.status() == "interrupted"):
                out.append(f"{tail.path.name}: the last line is incomplete ({tail.torn_tail} bytes; the run was "
                           "cut off while writing it) and is not shown")
        return out

    def points_since(self, row: int) -> dict[str, dict[str, Any]]:
        """Every metric's points from metrics row ``row`` on (a live poll)."""
        out = {}
        steps = self.steps[row:]
        for key, column in self.columns.items():
            values = column[row:]
            finite = np.isfinite(values)
            if finite.any():
                out[key] = {"x": steps[finite], "y": values[finite]}
        return out

    def downsampled(self, max_points: int, lo: float | None = None, hi: float | None = None
                    ) -> dict[str, dict[str, Any]]:
        """Every metric, at most ``max_points`` points each between steps ``lo`` and ``hi`` (:func:`downsample`)."""
        return {key: downsample(self.steps, column, max_points, lo, hi) for key, column in self.columns.items()}

    def samples(self) -> list[dict[str, Any]]:
        out = []
        try:
            names = os.listdir(self.run_dir / "samples")
        except OSError:
            return out
        prompts = self.sample_prompts() if names else []
        for name in names:
            match = _SAMPLE.match(name)
            if match:
                index = int(match.group(2))
                out.append({"step": int(match.group(1)), "index": index,
                            "kind": "latents" if match.group(3) else match.group(4), "path": f"samples/{name}",
                            "prompt": prompts[index] if index < len(prompts) else None})
        return sorted(out, key=lambda s: (s["index"], s["step"], s["kind"]))

    def checkpoints(self) -> list[dict[str, Any]]:
        out = []
        try:
            names = sorted(os.listdir(self.run_dir / "checkpoints"))
        except OSError:
            names = []
        for name in names:
            if name.startswith("step_"):
                complete = (self.run_dir / "checkpoints" / name / "complete.json").exists()
                out.append({"name": name, "complete": complete})
        loras = sorted(p.name for p in self.run_dir.glob("*.safetensors"))
        return out + [{"name": name, "complete": True, "lora": True} for name in loras]

    def details(self) -> dict[str, Any]:
        """What the run page shows once: the resolved config, the pre-flight report (``memory``: its VRAM and host
        plans as the text ``check`` prints), the LR finder's sweep."""
        config = _read_text(self.run_dir / "config.toml")
        preflight = _read_json(self.run_dir / "preflight.json")
        memory = None
        if isinstance(preflight, dict):
            with contextlib.suppress(KeyError, TypeError, ValueError):  # a report of another version: the raw JSON
                memory = "\n".join(memory_lines(preflight.get("memory_plan") or {},
                                                preflight.get("host_memory") or {})).strip("\n") or None
        return {"config": config, "preflight": preflight, "memory": memory, "lr_finder": self.lr_finder(),
                "keep": self.keep()}

    def keep(self) -> list[str] | None:
        """The step to keep as ``wantrain report`` prints it (``app.keep``), or None without the evidence."""
        path = self.run_dir / "metrics.jsonl"
        pick = pick_step(sorted(read_metrics(path), key=lambda r: r["step"]), self.run_dir) if path.is_file() else None
        return pick.lines() if pick is not None else None

    def lr_finder(self) -> dict[str, Any] | None:
        summary = _read_json(self.run_dir / "lr_finder.json")
        text = _read_text(self.run_dir / "lr_finder.csv")
        if summary is None and text is None:
            return None
        curves: dict[str, dict[str, list]] = {}
        for row in csv.DictReader(io.StringIO(text or "")):
            curve = curves.setdefault(row.get("expert") or "", {"lr": [], "raw": [], "smoothed": []})
            curve["lr"].append(_float(row.get("lr")))
            curve["raw"].append(_float(row.get("raw_loss")))
            curve["smoothed"].append(_float(row.get("smoothed_loss")))
        return {"summary": summary, "curves": curves}


def downsample(x: Any, y: Any, max_points: int, lo: float | None = None,
               hi: float | None = None) -> dict[str, Any]:
    """At most about ``max_points`` points of ``(x, y)`` between ``lo`` and ``hi``: each of ``max_points / 2``
    equal buckets keeps its lowest and its highest value, in step order, so spikes survive. Missing values are
    skipped."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)  # None -> NaN
    if lo is not None or hi is not None:
        keep = (xs >= (-np.inf if lo is None else lo)) & (xs <= (np.inf if hi is None else hi))
        xs, ys = xs[keep], ys[keep]
    finite = np.isfinite(ys)
    xs, ys = xs[finite], ys[finite]
    n = len(xs)
    if n > max_points >= 4:
        buckets = max_points // 2
        edges = np.linspace(0, n, buckets + 1).astype(np.int64)
        starts = edges[:-1]
        low = np.minimum.reduceat(ys, starts)
        high = np.maximum.reduceat(ys, starts)
        bucket_of = np.repeat(np.arange(buckets), np.diff(edges))
        first_low = _first_index(ys == low[bucket_of], bucket_of, buckets)
        first_high = _first_index(ys == high[bucket_of], bucket_of, buckets)
        picks = np.unique(np.concatenate([first_low, first_high]))
        xs, ys = xs[picks], ys[picks]
    return {"x": xs, "y": ys}


def _first_index(hit: np.ndarray, bucket_of: np.ndarray, buckets: int) -> np.ndarray:
    """Per bucket, the first index where ``hit`` holds (every bucket has one)."""
    where = np.flatnonzero(hit)
    first = np.full(buckets, -1, dtype=np.int64)
    first[bucket_of[where][::-1]] = where[::-1]
    return first[first >= 0]


def list_runs(root: Path) -> list[RunData]:
    """The run directories directly under ``root``, newest name first."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name, reverse=True)
    except OSError:
        return []
    return [RunData(Path(e.path)) for e in entries
            if is_safe_name(e.name) and not e.is_symlink() and is_run_dir(Path(e.path))]


def ask(run_dir: Path, action: str, source: str, *, ended: dict[str, Any] | bool | None = False) -> str:
    """Post ``action`` to a running run's inbox (``core.inbox``); returns the request id. Raises ``RunGone`` for
    a directory that is not a run, ``ValueError`` (one line) for a run that has ended or an unknown action.

    ``ended``: the run's ``RunEnded`` record as the caller knows it (the server's cached :class:`RunData`), or
    False to look for it in the event log (:func:`ended_record`, from the end of the file)."""
    if not is_run_dir(run_dir):
        raise RunGone(f"{run_dir} is not a run directory (no events.jsonl or config.toml)")
    if ended is False:
        ended = ended_record(run_dir)
    if ended:
        raise ValueError(f"the run in {run_dir} has ended ({ended.get('status')}); nothing can be asked of it")
    return post_request(run_dir, action, source)


_START_OR_END = re.compile(rb'"_type": ?"(RunStarted|RunEnded)"')
_TAIL_WINDOW = 64 << 10


def ended_record(run_dir: Path) -> dict[str, Any] | None:
    """The ``RunEnded`` record of the run's last start, or None while it runs (or never recorded one). A plain log
    is read backwards from its end in 64 KiB windows until a ``RunStarted`` or ``RunEnded`` line (one window for a
    run that ended, however long); a gzip log has to be decompressed from its start."""
    plain, compressed = run_dir / "events.jsonl", run_dir / "events.jsonl.gz"
    if not plain.exists() and compressed.exists():
        last = None
        for _, line, complete in iter_log_lines(compressed):
            found = _START_OR_END.search(line.encode()) if complete else None
            if found:
                last = line if found.group(1) == b"RunEnded" else None
        return _loads(last)
    try:
        fd = os.open(plain, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        end = os.fstat(fd).st_size
        window = _TAIL_WINDOW
        while True:
            start = max(0, end - window)
            data = os.pread(fd, end - start, start)
            found = None
            for found in _START_OR_END.finditer(data, data.find(b"\n") + 1 if start > 0 else 0):  # noqa: B007
                pass  # the last one: one C scan of the window
            if found is not None:
                if found.group(1) != b"RunEnded":
                    return None
                line_end = data.find(b"\n", found.end())
                return _loads(data[data.rfind(b"\n", 0, found.start()) + 1:line_end]) if line_end >= 0 else None
            if start == 0:
                return None
            window *= 4
    finally:
        os.close(fd)


def _loads(line: str | bytes | None) -> dict[str, Any] | None:
    try:
        record = orjson.loads(line) if line else None
    except orjson.JSONDecodeError:
        return None  # a torn line: not an end
    return record if isinstance(record, dict) else None


def _timeline_item(record: dict[str, Any]) -> dict[str, Any]:
    kind = str(record.get("_type", "?"))
    level = "info"
    if kind in ("OutOfMemory", "ObserverFailed") or (kind == "OptimizerStepped" and record.get("skipped")):
        level = "warning"
    if kind == "RunEnded" and record.get("status") in ("failed", "aborted"):
        level = "error"
    if kind == ControlRequested.__name__ and record.get("refused"):
        level = "warning"
    detail = {k: v for k, v in record.items() if k not in ("_type", "step", "seq", "wall_time", "schema")}
    return {"type": kind, "step": record.get("step"), "time": record.get("wall_time"), "level": level,
            "detail": detail}


def _iso_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        from datetime import datetime

        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _read_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        return fh.read(4 << 20).decode("utf-8", errors="replace")


def _read_json(path: Path) -> Any:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"error": f"{path.name} is not valid JSON"}


def _float(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
