"""Pure planning of ``wantrain prepare``: scenes from cuts, and each scene cut into clips on the frame buckets.

No I/O. Frame numbers are source frames counted from 0 in decode order (as :func:`wantrain.data.media.probe` and
``decode_video`` count them); a scene is ``[start, end)``. A scene is retimed as training retimes a video
(:func:`wantrain.data.plan.retimed_count`, output frame ``i`` shows source frame ``floor(i * source_fps / fps)``),
so a clip written at ``fps`` with ``F`` frames trains as exactly ``F`` frames: it lands on its bucket.

Windows (:func:`scene_windows`): clips of the **longest** bucket that fits the scene, one every ``stride`` frames
(default: the clip's length, so no frame is trained twice and a long static scene does not outweigh short ones),
while they fit; then the frames after the last window, when they hold the shortest bucket or more, make one clip
of the longest bucket that fits them. A scene shorter than the shortest bucket is dropped with that reason.
"""

from __future__ import annotations

import attrs

from wantrain.data.plan import pick_frame_bucket, retimed_count, source_index


@attrs.frozen
class Scene:
    """One shot of a source video: source frames ``[start, end)``. ``cut_score`` is the detector's score of the cut
    that opens it (None for the video's first scene), ``end_score`` the score of the cut that closes it (None for
    the last)."""

    index: int
    start: int
    end: int
    cut_score: float | None = None
    end_score: float | None = None

    @property
    def frames(self) -> int:
        return self.end - self.start


@attrs.frozen
class PlannedClip:
    """One clip to write: output frames ``[window_start, window_start + frames)`` of its retimed scene.
    ``source_indices`` are the source frames it shows, in order (repeats when the source is slower than ``fps``)."""

    name: str  # file name without the folder, e.g. "beach_scene003_clip01.mp4"
    scene: Scene
    window: int
    window_start: int
    frames: int  # the frame bucket it lands on
    source_indices: tuple[int, ...]

    @property
    def start_frame(self) -> int:
        return self.source_indices[0]

    @property
    def end_frame(self) -> int:
        """One past the last source frame shown."""
        return self.source_indices[-1] + 1


@attrs.frozen
class DroppedScene:
    scene: Scene
    frames: int  # after retiming
    reason: str


def scenes_from_cuts(cuts: list[int], total: int, scores: dict[int, float] | None = None) -> list[Scene]:
    """The scenes of a video of ``total`` frames cut before each frame of ``cuts`` (a cut at ``k``: frame ``k``
    opens a scene). Cuts outside ``1..total-1`` and repeats are ignored; ``scores`` maps a cut to its score."""
    scores = scores or {}
    edges = sorted({c for c in cuts if 0 < c < total})
    bounds = [0, *edges, total]
    return [Scene(index=k, start=a, end=b, cut_score=scores.get(a) if k else None,
                  end_score=scores.get(b) if b < total else None)
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def scene_windows(available: int, buckets: list[int], stride: int | None = None) -> list[tuple[int, int]]:
    """``(start, length)`` of each clip cut from ``available`` retimed frames (see the module docstring)."""
    longest = pick_frame_bucket(available, buckets)
    if longest is None:
        return []
    step = stride or longest
    windows = [(s, longest) for s in range(0, available - longest + 1, step)]
    end = windows[-1][0] + longest
    tail = pick_frame_bucket(available - end, buckets)
    if tail is not None:
        windows.append((end, tail))
    return windows


def plan_scene(scene: Scene, stem: str, *, source_fps: float, fps: float | None, buckets: list[int],
               stride: int | None = None) -> list[PlannedClip] | DroppedScene:
    """The clips of ``scene`` (named ``<stem>_scene<NNN>_clip<NN>.mp4``), or why it is dropped. ``fps`` None: no
    retiming (every source frame, the clip written at the source rate)."""
    available = retimed_count(scene.frames, source_fps, fps)
    windows = scene_windows(available, sorted(buckets), stride)
    if not windows:
        rate = fps or source_fps
        via = "" if available == scene.frames else f" ({scene.frames} at {source_fps:g} fps)"
        return DroppedScene(scene, available, f"too short: {available} frames at {rate:g} fps{via}; the shortest "
                                              f"frame bucket is {min(buckets)}")
    clips = []
    for k, (start, length) in enumerate(windows):
        indices = tuple(scene.start + source_index(start + i, source_fps, fps) for i in range(length))
        clips.append(PlannedClip(name=f"{stem}_scene{scene.index:03d}_clip{k:02d}.mp4", scene=scene, window=k,
                                 window_start=start, frames=length, source_indices=indices))
    return clips
