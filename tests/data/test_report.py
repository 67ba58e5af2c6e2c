"""The pre-flight report (the memory plan it prints: tests/models/test_memory_plan.py)."""

import json

from conftest import data_config, make_image, make_video

from wantrain.data import build_dataset


def test_report_counts_clips_per_bucket_steps_and_waste(tmp_path, tiny_spec):
    make_video(tmp_path, "v0", frames=13, width=48, height=32)
    make_video(tmp_path, "v1", frames=9)
    make_image(tmp_path, "i0")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    rep = data.report.to_json()
    assert {(b["width"], b["height"], b["frames"]): b["clips"] for b in rep["buckets"]} == {
        (32, 32, 1): 1, (32, 32, 9): 1, (32, 16, 9): 1}  # 3:2 -> 2:1 is the nearest ratio within 32*32
    assert rep["steps_per_epoch"] == 3 and rep["clips"] == 3
    assert rep["frames_left_over"] == 4 and rep["source_frames_total"] == 22
    json.dumps(rep)  # plain data
    text = data.report.format()
    assert "32x32x9" in text and "steps per epoch: 3" in text and "frames left over: 18.2%" in text


def test_pixels_cropped_is_the_share_cut_by_the_centre_crop(tmp_path, tiny_spec):
    make_image(tmp_path, "wide", width=64, height=32)  # 2:1 into a 1:1-only bucket set: half the width is cut
    data = build_dataset(data_config(tmp_path, aspect_ratios=[1.0]), spec=tiny_spec, seed=0, batch_size=1)
    assert round(data.report.pixels_cropped_pct, 1) == 50.0
