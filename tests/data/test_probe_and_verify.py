"""Probe, then verify: real frame counts, lying containers, decode shortfalls."""

import numpy as np
import pytest
from conftest import data_config, make_corrupt_tail_video, make_lying_video, make_video

from wantrain.data import build_dataset
from wantrain.data.demo import write_video
from wantrain.data.media import probe

RED, BLACK = (230, 20, 20), (0, 0, 0)


def _marked_video(path, rotation, width=48, height=32, frames=9):
    """Landscape frames, black with a red square in the stored top-left corner, written with a display rotation."""
    pictures = np.zeros((frames, height, width, 3), np.uint8)
    pictures[:, :8, :8] = RED
    write_video(path, pictures, 16.0, rotation=rotation)
    path.with_suffix(".txt").write_text("a red square")
    return path


@pytest.mark.parametrize(("rotation", "corner"), [(-90, "top_right"), (90, "bottom_left"), (180, "bottom_right"),
                                                  (0, "top_left")])
def test_video_display_rotation_is_applied_like_exif_on_images(tmp_path, tiny_spec, rotation, corner):
    path = _marked_video(tmp_path / "phone.mp4", rotation)
    info = probe(path)
    assert (info.width, info.height) == ((32, 48) if rotation in (90, -90) else (48, 32))
    data = build_dataset(data_config(tmp_path, resolutions=[40]), spec=tiny_spec, seed=0, batch_size=1)
    (clip,) = data.clips
    assert ("rotation" in clip.latent_params()) == (rotation != 0)  # re-encodes rotated clips cached unrotated
    pixels = next(data.batches(None))["pixels"][0, :, 0]  # [3, H, W], first frame
    assert tuple(pixels.shape[1:]) == (clip.height, clip.width)
    red = (pixels[0] > 0.5) & (pixels[1] < 0)
    h, w = red.shape
    corners = {"top_left": red[:4, :4], "top_right": red[:4, w - 4:], "bottom_left": red[h - 4:, :4],
               "bottom_right": red[h - 4:, w - 4:]}
    assert {name for name, patch in corners.items() if patch.all()} == {corner}


def test_lying_container_frame_count_is_replaced_by_the_demuxed_count(tmp_path, tiny_spec):
    make_lying_video(tmp_path, "cut", frames=25, keep=13)
    data = build_dataset(data_config(tmp_path, frames=[9, 17, 25]), spec=tiny_spec, seed=0, batch_size=1)
    assert data.report.frame_count_mismatches == [
        {"path": str(tmp_path / "cut.mp4"), "container_frames": 25, "frames": 13}]
    assert [c.frames for c in data.clips] == [9]  # bucketed by what the file holds, not by the header's 25
    batch = next(data.batches(None))
    assert batch["pixels"].shape == (1, 3, 9, 32, 32)


def test_decode_shortfall_rebuckets_the_clip_and_reports_it(tmp_path, tiny_spec):
    make_corrupt_tail_video(tmp_path, "broken", frames=25, good=13)  # demuxes 25 packets, decodes 13 frames
    make_video(tmp_path, "fine", frames=25)
    data = build_dataset(data_config(tmp_path, frames=[9, 25]), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(c.frames for c in data.clips) == [25, 25]
    it = data.batches(None)
    seen = [next(it) for _ in range(4)]
    (event,) = data.report.verification
    assert event["action"] == "re-bucketed to 32x32x9" and "after 13 of 25 frames" in event["reason"]
    assert sorted(c.frames for c in data.clips) == [9, 25]
    assert any(b["bucket"] == (32, 32, 9) and b["paths"] == [str(tmp_path / "broken.mp4")] for b in seen)


def test_decode_shortfall_below_every_bucket_skips_the_clip_and_training_goes_on(tmp_path, tiny_spec):
    make_corrupt_tail_video(tmp_path, "broken", frames=25, good=5)
    make_video(tmp_path, "fine", frames=25)
    data = build_dataset(data_config(tmp_path, frames=[9, 25]), spec=tiny_spec, seed=0, batch_size=2)
    batches = [next(data.batches(None)) for _ in range(1)] + list(_take(data.batches(None), 3))
    assert all(b["paths"] == [str(tmp_path / "fine.mp4")] for b in batches)
    assert data.report.verification[0]["action"] == "skipped"
    assert not data.clips[0].active


def test_verified_frame_count_is_remembered_in_the_cache_folder(tmp_path, tiny_spec, encoders):
    make_corrupt_tail_video(tmp_path, "broken", frames=25, good=13)
    cfg = data_config(tmp_path, frames=[9, 25])
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    next(data.batches(encoders))  # decode -> shortfall -> remembered
    again = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    assert [c.frames for c in again.clips] == [9]  # planned right from the start


def _take(it, n):
    for _ in range(n):
        yield next(it)
