"""Frame rate retiming and clip extraction (head, uniform, slide) with leftover accounting."""

import pytest
import torch
from conftest import data_config, make_image, make_video

from wantrain.core.errors import UserError
from wantrain.data import build_dataset
from wantrain.data.plan import clip_starts, covered_frames, retimed_count, source_index
from wantrain.models.wan22.variants import variant_spec


def test_24fps_video_is_retimed_to_the_variants_16fps_and_reported(tmp_path, tiny_spec):
    make_video(tmp_path, "fast", frames=27, fps=24.0)
    data = build_dataset(data_config(tmp_path, frames=[9, 17]), spec=tiny_spec, seed=0, batch_size=1)
    (r,) = data.report.retimed
    assert (r["source_frames"], r["source_fps"], r["frames"], r["target_fps"]) == (27, 24.0, 18, 16.0)
    assert [c.frames for c in data.clips] == [17]
    assert data.clips[0].source_indices()[:5] == [0, 1, 3, 4, 6]  # every third source frame dropped
    assert "27 frames at 24 fps -> 18 frames at 16 fps" in data.report.format()


def test_ti2v_variant_targets_24fps_and_fps_key_overrides_it(tmp_path):
    make_video(tmp_path, "v", frames=25, fps=24.0)
    spec = variant_spec("tiny-ti2v")
    default = build_dataset(data_config(tmp_path, frames=[25]), spec=spec, seed=0, batch_size=1)
    assert default.report.target_fps == 24.0 and default.clips[0].frames == 25
    slowed = build_dataset(data_config(tmp_path, frames=[9, 25], fps=12.0), spec=spec, seed=0, batch_size=1)
    assert slowed.report.retimed[0]["frames"] == 12 and slowed.clips[0].frames == 9


def test_retime_off_uses_every_source_frame(tmp_path, tiny_spec):
    make_video(tmp_path, "fast", frames=25, fps=24.0)
    data = build_dataset(data_config(tmp_path, frames=[25], retime="off"), spec=tiny_spec, seed=0, batch_size=1)
    assert data.clips[0].frames == 25 and data.clips[0].source_indices() == list(range(25))


def test_slower_source_repeats_frames():
    assert retimed_count(8, 8.0, 16.0) == 16
    assert [source_index(i, 8.0, 16.0) for i in range(4)] == [0, 0, 1, 1]


def test_head_uniform_and_slide_cut_the_expected_clips(tmp_path, tiny_spec):
    make_video(tmp_path, "long", frames=41)
    starts = {}
    for mode in ("head", "uniform", "slide"):
        data = build_dataset(data_config(tmp_path, frames=[9], clip_mode=mode, clips_per_video=3, clip_stride=8),
                             spec=tiny_spec, seed=0, batch_size=1)
        starts[mode] = [c.start for c in data.clips]
        assert all(c.frames == 9 for c in data.clips)
    assert starts == {"head": [0], "uniform": [0, 16, 32], "slide": [0, 8, 16, 24, 32]}


def test_leftover_frames_are_counted(tmp_path, tiny_spec):
    make_video(tmp_path, "long", frames=41)
    head = build_dataset(data_config(tmp_path, frames=[9]), spec=tiny_spec, seed=0, batch_size=1)
    assert (head.report.frames_left_over, head.report.source_frames_total) == (32, 41)
    slide = build_dataset(data_config(tmp_path, frames=[9], clip_mode="slide"), spec=tiny_spec, seed=0, batch_size=1)
    assert slide.report.frames_left_over == 41 - 36 and round(slide.report.frames_left_over_pct, 1) == 12.2


def test_clip_takes_the_longest_frame_bucket_that_fits(tmp_path, tiny_spec):
    make_video(tmp_path, "a", frames=20)
    make_video(tmp_path, "b", frames=12)
    data = build_dataset(data_config(tmp_path, frames=[5, 9, 17]), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(c.frames for c in data.clips) == [9, 17]


def test_uniform_clip_pixels_come_from_their_own_window(tmp_path, tiny_spec):
    make_video(tmp_path, "long", frames=33)
    data = build_dataset(data_config(tmp_path, frames=[9], clip_mode="uniform", clips_per_video=2, shuffle=False),
                         spec=tiny_spec, seed=0, batch_size=2)
    px = next(data.batches(None))["pixels"]
    assert px.shape == (2, 3, 9, 32, 32)
    assert not torch.allclose(px[0], px[1])  # start 0 vs start 24: the shape has moved


def test_starts_helpers():
    assert clip_starts(10, 9, "uniform", clips_per_video=5, stride=None) == [0, 1]
    assert covered_frames([0, 4], 9) == 13


@pytest.mark.parametrize("variant", ["i2v-a14b", "tiny-i2v"])
def test_image_to_video_variants_skip_images_with_a_reason(tmp_path, variant):
    make_video(tmp_path, "v0", frames=9)
    make_image(tmp_path, "still")
    data = build_dataset(data_config(tmp_path, resolutions=[64]), spec=variant_spec(variant), seed=0, batch_size=1)
    assert [c.path.name for c in data.clips] == ["v0.mp4"]
    (skipped,) = data.report.skipped
    assert skipped["path"].endswith("still.png") and f"cannot train {variant}" in skipped["reason"]
    assert "still.png: an image cannot train" in data.report.format()
    # the other variants train it
    other = build_dataset(data_config(tmp_path, resolutions=[64]), spec=variant_spec("tiny-ti2v"), seed=0, batch_size=1)
    assert sorted(c.kind for c in other.clips) == ["image", "video"]


def test_a_one_frame_bucket_is_refused_for_image_to_video(tmp_path):
    make_video(tmp_path, "v0", frames=9)
    with pytest.raises(UserError, match=r"frame bucket 1 in 'data.frames' does not suit tiny-i2v") as err:
        build_dataset(data_config(tmp_path, frames=[1, 9]), spec=variant_spec("tiny-i2v"), seed=0, batch_size=1)
    assert "\n" not in str(err.value)
