"""Scene cuts for ``wantrain prepare``: PySceneDetect's content detector, fed by one PyAV decode pass.

Why PySceneDetect's ``ContentDetector``: it is the maintained, widely used detector for hard cuts (HSV difference
of consecutive frames against a threshold, with a filter that merges flashes), and its ``scenedetect-headless``
package depends on ``opencv-python-headless``, the OpenCV build wantrain already uses, so no second OpenCV is
installed. OpenCV alone has no shot detector to maintain; writing one here would be ours to tune.

How it is fed: frames are decoded by PyAV (as training decodes them: frame ``k`` is the ``k``-th decoded frame) and
shrunk by FFmpeg's scaler to :data:`DETECT_WIDTH` pixels wide while converted to BGR, which is the width
PySceneDetect's own auto-downscale picks for HD video; the detector then sees each frame through its public
``process_frame`` / ``post_process`` interface. A cut reported at frame ``k`` means frame ``k`` opens a scene.
The score of each cut is the detector's ``content_val`` of that frame, recorded through its stats interface.

Nothing here raises on bad media: a decode that breaks returns the frames read so far with the error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

DETECT_WIDTH = 256
"""Frames are shrunk to this width for detection (PySceneDetect's ``DEFAULT_MIN_WIDTH`` for auto-downscale)."""


@attrs.frozen
class DetectorSettings:
    """The content detector's settings (PySceneDetect's names and defaults)."""

    threshold: float = 27.0
    min_scene_len: int = 15  # frames; cuts closer than this are merged (flashes)

    def identity(self) -> dict:
        import scenedetect

        return {"detector": "scenedetect.ContentDetector", "version": scenedetect.__version__,
                "threshold": self.threshold, "min_scene_len": self.min_scene_len, "width": DETECT_WIDTH}


@attrs.frozen
class Detection:
    """What one pass found: ``frames`` decoded, the cut frames and their scores. ``error`` is set when decoding
    stopped early (then ``frames`` is what was read)."""

    frames: int
    cuts: tuple[int, ...]
    scores: tuple[float, ...]
    error: str | None = None

    def to_json(self) -> dict:
        return {"frames": self.frames, "cuts": list(self.cuts), "scores": list(self.scores), "error": self.error}

    @classmethod
    def from_json(cls, data: dict) -> Detection:
        return cls(frames=int(data["frames"]), cuts=tuple(int(c) for c in data["cuts"]),
                   scores=tuple(float(s) for s in data["scores"]), error=data.get("error"))


def _score_recorder():
    """A PySceneDetect ``StatsManager`` that keeps only each frame's ``content_val`` (the full one keeps a dict of
    every metric per frame)."""
    from scenedetect.detectors import ContentDetector
    from scenedetect.stats_manager import StatsManager

    class CutScores(StatsManager):
        def __init__(self) -> None:
            super().__init__()
            self.scores: dict[int, float] = {}

        def set_metrics(self, timecode, metric_kv_dict) -> None:
            self.scores[timecode.frame_num] = float(metric_kv_dict[ContentDetector.FRAME_SCORE_KEY])

    return CutScores()


def detect_cuts(path: Path, fps: float, settings: DetectorSettings,
                on_frame: Callable[[int], None] | None = None) -> Detection:
    """Decode ``path`` once and find its hard cuts. ``on_frame(n)`` is called every few frames with how many frames
    were decoded since the last call (for a progress bar)."""
    import av
    from scenedetect.common import FrameTimecode
    from scenedetect.detectors import ContentDetector

    detector = ContentDetector(threshold=settings.threshold, min_scene_len=settings.min_scene_len)
    recorder = _score_recorder()
    detector.stats_manager = recorder
    cuts: list[int] = []
    count = 0
    pending = 0
    error = None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            width, height = stream.codec_context.width, stream.codec_context.height
            small_w = min(width, DETECT_WIDTH)
            small_h = max(2, round(height * small_w / width / 2) * 2)
            for frame in container.decode(stream):
                image = frame.reformat(width=small_w, height=small_h, format="bgr24",
                                       interpolation="FAST_BILINEAR").to_ndarray()
                cuts.extend(c.frame_num for c in detector.process_frame(FrameTimecode(count, fps), image))
                count += 1
                pending += 1
                if on_frame is not None and pending >= 32:
                    on_frame(pending)
                    pending = 0
    except Exception as exc:  # a corrupt packet or a broken file: the frames so far are what there is
        error = " ".join(str(exc).split())[:200] or type(exc).__name__
    if count:
        cuts.extend(c.frame_num for c in detector.post_process(FrameTimecode(count - 1, fps)))
    if on_frame is not None and pending:
        on_frame(pending)
    kept = sorted({c for c in cuts if 0 < c < count})
    return Detection(frames=count, cuts=tuple(kept), scores=tuple(recorder.scores.get(c, 0.0) for c in kept),
                     error=error)
