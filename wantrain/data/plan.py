"""Pure planning: retiming, clip extraction and buckets. No I/O, so the pre-flight report is cheap and testable.

Retiming maps output frame ``i`` (at the target rate) to source frame ``floor(i * src_fps / target_fps)``; a
video of ``N`` source frames yields ``floor(N * target_fps / src_fps)`` frames (frames are dropped when the source
is faster, repeated when it is slower). With ``retime = "off"`` every source frame is used as-is.

A clip takes the longest frame bucket that fits the retimed video. ``head`` cuts one clip from the start,
``uniform`` cuts ``clips_per_video`` clips with evenly spaced starts, ``slide`` cuts one every ``stride`` frames.
Frames no clip covers are counted as left over.

Size buckets: for each area budget ``A`` (a square side ``s``: ``A = s*s``) and each aspect ratio ``r`` the
bucket is the ``w x h`` (both multiples of the variant's ``spatial_multiple``) with ``w*h <= A`` whose ratio is
closest to ``r`` (in log ratio). A medium goes to the bucket of its budget whose ratio is nearest its own.
"""

from __future__ import annotations

import math

import attrs


def retimed_count(source_frames: int, source_fps: float, target_fps: float | None) -> int:
    """Frames after retiming (``target_fps`` None: no retiming)."""
    if target_fps is None or abs(source_fps - target_fps) < 1e-6:
        return source_frames
    return max(0, math.floor(source_frames * target_fps / source_fps + 1e-9))


def source_index(i: int, source_fps: float, target_fps: float | None) -> int:
    """Source frame shown at output frame ``i``."""
    if target_fps is None or abs(source_fps - target_fps) < 1e-6:
        return i
    return math.floor(i * source_fps / target_fps + 1e-9)


def pick_frame_bucket(available: int, buckets: list[int]) -> int | None:
    """The longest bucket not longer than ``available``; None when even the shortest is too long."""
    fitting = [b for b in buckets if b <= available]
    return max(fitting) if fitting else None


def clip_starts(available: int, length: int, mode: str, *, clips_per_video: int, stride: int | None) -> list[int]:
    """Start frames of the clips of ``length`` frames cut from ``available`` frames."""
    room = available - length
    if room < 0:
        return []
    if mode == "head":
        return [0]
    if mode == "uniform":
        n = clips_per_video
        if n == 1:
            return [room // 2]
        return sorted({round(k * room / (n - 1)) for k in range(n)})
    if mode == "slide":
        step = stride or length
        return list(range(0, room + 1, step))
    raise ValueError(f"unknown clip mode {mode!r}")  # validated by the config: a bug if reached


def covered_frames(starts: list[int], length: int) -> int:
    covered = 0
    end = -1
    for s in sorted(starts):
        covered += max(0, s + length - max(s, end))
        end = max(end, s + length)
    return covered


@attrs.frozen
class SizeBucket:
    width: int
    height: int

    @property
    def ratio(self) -> float:
        return self.width / self.height


def size_buckets(side: int, aspect_ratios: list[float], multiple: int) -> list[SizeBucket]:
    """The size buckets of one area budget ``side * side``, sorted by ratio, duplicates removed."""
    area = side * side
    out: set[SizeBucket] = set()
    for r in aspect_ratios:
        w0, h0 = math.sqrt(area * r), math.sqrt(area / r)
        best = None
        for w in _neighbours(w0, multiple):
            for h in _neighbours(h0, multiple):
                if w * h > area and not (w == multiple or h == multiple):
                    continue
                score = (abs(math.log((w / h) / r)), -w * h)
                if best is None or score < best[0]:
                    best = (score, SizeBucket(w, h))
        if best is not None:
            out.add(best[1])
    return sorted(out, key=lambda b: (b.ratio, b.width))


def _neighbours(x: float, multiple: int) -> set[int]:
    """The multiples of ``multiple`` just below and above ``x`` (at least ``multiple``)."""
    return {max(multiple, math.floor(x / multiple) * multiple), max(multiple, math.ceil(x / multiple) * multiple)}


def nearest_bucket(width: int, height: int, buckets: list[SizeBucket]) -> SizeBucket:
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.ratio) - ratio), -b.width * b.height))
