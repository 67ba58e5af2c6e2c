"""The motion figure (wantrain/observers/evaluation/motion.py): optical-flow magnitude per frame pair."""

from __future__ import annotations

import numpy as np
import pytest

from wantrain.observers.evaluation.motion import clip_motion, motion, motion_metrics


def moving_texture(pixels_per_frame: int, frames: int = 9, size: int = 64) -> np.ndarray:
    """A smooth random texture sliding right by ``pixels_per_frame`` each frame: uint8 [F, H, W, 3]."""
    import cv2

    texture = cv2.GaussianBlur(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8), (5, 5), 0)
    return np.stack([np.roll(texture, pixels_per_frame * i, axis=1) for i in range(frames)])


def test_still_slow_and_fast_clips_rank_by_their_movement_and_read_in_pixels_per_frame():
    still, slow, fast = (motion(moving_texture(v)) for v in (0, 1, 4))
    assert still < slow < fast
    assert still == pytest.approx(0.0, abs=0.05)
    assert slow == pytest.approx(1.0, rel=0.1) and fast == pytest.approx(4.0, rel=0.1)


def test_a_single_frame_has_no_motion_and_clips_average_over_those_that_move():
    assert motion(moving_texture(2, frames=1)) is None
    assert clip_motion([moving_texture(1), moving_texture(3), moving_texture(2, frames=1)]) == pytest.approx(
        2.0, rel=0.1)
    assert clip_motion([]) is None


def test_round_metrics_are_each_prompts_figure_their_mean_and_the_ratio_to_the_clips():
    values = motion_metrics({0: 1.0, 1: 3.0, 2: None}, reference=4.0)
    assert values == {"samples/motion/00": 1.0, "samples/motion/01": 3.0, "samples/motion": 2.0,
                      "samples/motion_ratio": 0.5}
    assert "samples/motion_ratio" not in motion_metrics({0: 1.0}, reference=None)
    assert motion_metrics({0: None}, reference=4.0) == {}
