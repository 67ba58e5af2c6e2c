"""Writing the clips of ``wantrain prepare``: one sequential PyAV decode of a source feeds every clip cut from it.

Each clip is encoded with H.264 (libx264, ``yuv420p``, constant quality ``crf``) at its frame rate, straight from
the decoded frames (no RGB round trip), resized only when ``max_side`` asks for it, with the source's display
rotation carried into the clip's container. A clip is written whole or not at all: it is encoded into a temporary
sibling (``wantrain.core.atomic.temporary_name``), fsync'ed, then renamed to its name; an interrupt or a broken
source removes the temporary file. Clips may overlap (a stride shorter than the clip): each has its own encoder,
fed the frames it shows, repeats included (a source slower than the clip's rate).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import attrs

from wantrain.core.atomic import fsync_dir, fsync_file, is_storage_error, storage_error, temporary_name


@attrs.frozen
class EncodeSettings:
    """How clips are encoded. ``max_side`` None keeps the source size (rounded down to even sides)."""

    crf: int = 18
    preset: str = "veryfast"
    max_side: int | None = None

    def identity(self) -> dict:
        return {"codec": "libx264", "crf": self.crf, "preset": self.preset, "max_side": self.max_side}


def output_size(width: int, height: int, max_side: int | None) -> tuple[int, int]:
    """The clip's stored size: the source's, scaled so its longer side is at most ``max_side``, sides even."""
    scale = min(1.0, max_side / max(width, height)) if max_side else 1.0
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


class ClipEncoder:
    """One clip being encoded into its temporary file; :meth:`finish` gives it its name, :meth:`abort` removes it."""

    def __init__(self, path: Path, fps: float, width: int, height: int, rotation: int, settings: EncodeSettings):
        import av

        self.path = path
        self.tmp = temporary_name(path)
        self.rate = Fraction(fps).limit_denominator(1001)
        self.width, self.height = width, height
        self.count = 0
        self.container = av.open(str(self.tmp), "w", format="mp4")
        try:
            self.stream = self.container.add_stream("libx264", rate=self.rate)
            self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
            self.stream.codec_context.options = {"crf": str(settings.crf), "preset": settings.preset}
            if rotation:
                self.stream.set_display_rotation(rotation)
        except BaseException:
            self.abort()
            raise

    def add(self, frame) -> None:
        """Append one decoded ``av.VideoFrame`` (any size and pixel format)."""
        if frame.width != self.width or frame.height != self.height or frame.format.name != "yuv420p":
            frame = frame.reformat(width=self.width, height=self.height, format="yuv420p", interpolation="BICUBIC")
        frame.pts = self.count
        frame.time_base = 1 / self.rate
        for packet in self.stream.encode(frame):
            self.container.mux(packet)
        self.count += 1

    def finish(self) -> Path:
        try:
            for packet in self.stream.encode():
                self.container.mux(packet)
            self.container.close()
            fsync_file(self.tmp)
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, Exception) and is_storage_error(exc):
                raise storage_error("clip", self.path, exc) from exc
            raise
        return self.path

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.container.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)


@attrs.frozen
class ClipJob:
    """A clip to write: where, and the source frames it shows, in order."""

    path: Path
    source_indices: tuple[int, ...]
    fps: float


def write_clips(source: Path, jobs: list[ClipJob], *, rotation: int, settings: EncodeSettings,
                on_frame: Callable[[int], None] | None = None,
                on_written: Callable[[ClipJob], None] | None = None) -> tuple[list[ClipJob], str | None]:
    """Decode ``source`` up to the last frame any job needs and write every job's clip. Returns the jobs that could
    not be written (the source ended or broke before their last frame) and the decoder's error, if any.
    ``on_written(job)`` is called as each clip gets its name (its manifest follows it); ``on_frame(n)`` counts
    decoded frames. Any exception (Ctrl-C included) removes every unfinished clip's temporary file."""
    import av

    pending = sorted(jobs, key=lambda j: j.source_indices[0])
    last = max(j.source_indices[-1] for j in jobs)
    active: list[tuple[ClipJob, ClipEncoder, list[int]]] = []  # job, encoder, [next position]
    index = -1
    error = None
    ticks = 0
    try:
        with av.open(str(source)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            size = output_size(stream.codec_context.width, stream.codec_context.height, settings.max_side)
            try:
                for frame in container.decode(stream):
                    index += 1
                    ticks += 1
                    if on_frame is not None and ticks >= 16:
                        on_frame(ticks)
                        ticks = 0
                    while pending and pending[0].source_indices[0] == index:
                        job = pending.pop(0)
                        active.append((job, ClipEncoder(job.path, job.fps, *size, rotation, settings), [0]))
                    for job, encoder, pos in active:
                        while pos[0] < len(job.source_indices) and job.source_indices[pos[0]] == index:
                            encoder.add(frame)
                            pos[0] += 1
                    for item in [a for a in active if a[2][0] == len(a[0].source_indices)]:
                        item[1].finish()
                        active.remove(item)
                        if on_written is not None:
                            on_written(item[0])
                    if index >= last:
                        break
            except av.error.FFmpegError as exc:  # a corrupt packet: the clips finished so far are kept
                error = " ".join(str(exc).split())[:200]
    finally:
        for _, encoder, _ in active:
            encoder.abort()
        if on_frame is not None and ticks:
            on_frame(ticks)
    unwritten = [j for j, _, _ in active] + pending
    return unwritten, error
