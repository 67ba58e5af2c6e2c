"""Every kind of bad medium is skipped with a reason; nothing stops the run."""

import pytest
from conftest import data_config, make_image, make_video

from wantrain.core.errors import UserError
from wantrain.data import build_dataset


def _reasons(data):
    return {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in data.report.skipped}


def test_each_bad_media_kind_is_skipped_with_its_reason(tmp_path, tiny_spec):
    make_video(tmp_path, "good", frames=9)
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "zero.txt").write_text("x")
    good = (tmp_path / "good.mp4").read_bytes()
    (tmp_path / "truncated.mp4").write_bytes(good[: len(good) // 3])  # moov at the end: cut off
    (tmp_path / "truncated.txt").write_text("x")
    (tmp_path / "garbage.mp4").write_bytes(bytes(range(256)) * 20)
    (tmp_path / "garbage.txt").write_text("x")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"nonsense" * 10)
    (tmp_path / "broken.txt").write_text("x")
    make_image(tmp_path, "nocaption", caption=None)
    img = make_image(tmp_path, "latin1")
    img.with_suffix(".txt").write_bytes("caf\xe9".encode("latin-1"))
    make_video(tmp_path, "short", frames=5)
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    reasons = _reasons(data)
    assert reasons["zero.mp4"] == "empty file (0 bytes)"
    assert reasons["truncated.mp4"].startswith(("cannot open as video", "no video stream found"))
    assert reasons["garbage.mp4"].startswith("cannot open as video")
    assert reasons["broken.png"].startswith("unreadable image")
    assert reasons["nocaption.png"].startswith("no caption file nocaption.txt")
    assert reasons["latin1.png"].startswith("caption latin1.txt is not UTF-8")
    assert reasons["short.mp4"].startswith("too short: 5 frames at 16 fps; the shortest frame bucket is 9")
    assert [c.path.name for c in data.clips] == ["good.mp4"]
    assert "skipped files: 7" in data.report.format()


def test_missing_caption_can_mean_empty_caption(tmp_path, tiny_spec):
    make_image(tmp_path, "nocaption", caption=None)
    data = build_dataset(data_config(tmp_path, missing_caption="empty"), spec=tiny_spec, seed=0, batch_size=1)
    assert [c.caption for c in data.clips] == [""] and not data.report.skipped


def test_image_broken_after_probe_is_skipped_at_decode_time(tmp_path, tiny_spec):
    make_image(tmp_path, "ok")
    bad = make_image(tmp_path, "later_broken")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=2)
    bad.write_bytes(bad.read_bytes()[:40])
    batch = next(data.batches(None))
    assert batch["paths"] == [str(tmp_path / "ok.png")]
    assert data.report.verification[0]["action"] == "skipped"


def test_no_usable_sample_is_one_user_error(tmp_path, tiny_spec):
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "zero.txt").write_text("x")
    with pytest.raises(UserError, match=r"no usable sample .* 1 files skipped; first: .*zero.mp4: empty file"):
        build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)


def test_missing_data_folder_is_a_user_error(tmp_path, tiny_spec):
    with pytest.raises(UserError, match="is not a folder"):
        build_dataset(data_config(tmp_path / "nope"), spec=tiny_spec, seed=0, batch_size=1)


def test_files_of_other_types_are_listed_as_ignored(tmp_path, tiny_spec):
    make_image(tmp_path, "ok")
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "layers.xcf").write_bytes(b"gimp xcf")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(p["path"].rsplit("/", 1)[-1] for p in data.report.ignored_files) == ["layers.xcf", "notes.json"]
    assert "ignored files" in data.report.format()


def test_exif_rotated_photo_is_bucketed_and_loaded_upright(tmp_path, tiny_spec):
    from PIL import Image

    pic = Image.new("RGB", (64, 32), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees when shown
    pic.save(tmp_path / "phone.jpg", exif=exif)
    (tmp_path / "phone.txt").write_text("a red card")
    data = build_dataset(data_config(tmp_path, resolutions=[64]), spec=tiny_spec, seed=0, batch_size=1)
    (clip,) = data.clips
    assert clip.height > clip.width  # portrait, as shown
    assert next(data.batches(None))["pixels"].shape == (1, 3, 1, clip.height, clip.width)
