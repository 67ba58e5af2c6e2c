"""How much a video moves: the mean optical-flow magnitude between consecutive frames, through OpenCV.

``motion(frames)``: for each pair of consecutive frames (uint8 ``[F, H, W, 3]``, grey-scaled), the dense optical flow
of Farnebäck's method (``cv2.calcOpticalFlowFarneback``, OpenCV's defaults of its sample code: pyramid scale 0.5,
3 levels, 15-pixel window, 3 iterations, poly_n 5, poly_sigma 1.2), its magnitude averaged over the pixels; then
averaged over the pairs. Unit: **pixels per frame at the video's size**, so a figure compares with another at the
same size only: the training clips are measured at the sample's size (``clip_motion``).

Metrics of a sampling round (host floats, docs/metrics.md; the sample observer logs them):

* ``samples/motion/NN`` -- the figure of prompt NN's video;
* ``samples/motion`` -- their mean over the round's videos (of more than one frame);
* ``samples/motion_ratio`` -- ``samples/motion`` over the training clips' figure at the first video prompt's size
  (1: the samples move as much as the clips; 0.2: they barely move; 3: they move too fast). Absent when no
  training clip is a video.

Cost: OpenCV on the CPU, a few milliseconds per frame pair at sample sizes (bench/bench_motion.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

FARNEBACK = dict(pyr_scale=0.5, levels=3, winsize=15, iterations=3, poly_n=5, poly_sigma=1.2, flags=0)


def flow_magnitudes(frames: np.ndarray) -> list[float]:
    """The mean flow magnitude (pixels) of each consecutive pair of ``frames`` (uint8 ``[F, H, W, 3]``)."""
    import cv2

    grey = [cv2.cvtColor(np.ascontiguousarray(f), cv2.COLOR_RGB2GRAY) for f in frames]
    out = []
    for a, b in zip(grey, grey[1:], strict=False):
        flow = cv2.calcOpticalFlowFarneback(a, b, None, **FARNEBACK)
        out.append(float(np.sqrt((flow.astype(np.float64) ** 2).sum(axis=-1)).mean()))
    return out


def motion(frames: np.ndarray) -> float | None:
    """Mean flow magnitude over the frame pairs of ``frames``; None for a single frame (no motion to measure)."""
    pairs = flow_magnitudes(frames)
    return sum(pairs) / len(pairs) if pairs else None


def clip_motion(videos: Iterable[np.ndarray]) -> float | None:
    """The training clips' figure: the mean of :func:`motion` over ``videos`` (each uint8 ``[F, H, W, 3]`` at the
    sample size); None when none has two frames."""
    figures = [m for m in (motion(v) for v in videos) if m is not None]
    return sum(figures) / len(figures) if figures else None


def motion_metrics(per_video: dict[int, float | None], reference: float | None) -> dict[str, float]:
    """The ``samples/motion*`` metrics of one round (see the module docstring) from each prompt's figure."""
    values = {f"samples/motion/{i:02d}": m for i, m in per_video.items() if m is not None}
    if not values:
        return {}
    mean = sum(values.values()) / len(values)
    values["samples/motion"] = mean
    if reference is not None and reference > 0:
        values["samples/motion_ratio"] = mean / reference
    return values
