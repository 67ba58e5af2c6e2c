"""Probe, then verify: real frame counts, lying containers, decode shortfalls."""

from conftest import data_config, make_corrupt_tail_video, make_lying_video, make_video

from wantrain.data import build_dataset


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
