"""High bit depths, huge sources and file accounting: nothing trains wrong, nothing blows up memory, and every
file under a data folder is used, skipped with a reason or ignored, and listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import av
import numpy as np
import pytest
from conftest import data_config, make_image, make_video
from PIL import Image

from wantrain.cli.main import main
from wantrain.data import build_dataset
from wantrain.data import media as media_module
from wantrain.data.media import decode_video, fit, load_image, upright


def test_a_16_bit_grayscale_png_decodes_as_its_ramp_not_white(tmp_path):
    ramp = np.repeat((np.arange(256, dtype=np.uint32) * 257).astype(np.uint16)[None], 16, axis=0)  # 0..65535
    path = tmp_path / "ramp.png"
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode.startswith("I")  # Pillow reads it as a 16-bit mode, not L
    pixels = load_image(path, 256, 16)[0]
    assert pixels.shape == (16, 256, 3) and (pixels[..., 0] == pixels[..., 2]).all()
    assert np.abs(pixels[8, :, 0].astype(int) - np.arange(256)).max() <= 1  # the ramp, 8-bit


def test_a_video_frame_is_scaled_by_the_decoder_never_converted_at_full_size(tmp_path, monkeypatch):
    path = make_video(tmp_path, "wide", frames=9, width=96, height=64)
    with av.open(str(path)) as c:
        frame = next(c.decode(video=0))
        reference = fit(upright(frame.to_image(), 90), 32, 48)
    monkeypatch.setattr(av.VideoFrame, "to_image", lambda self, *a, **k: pytest.fail("full-size RGB picture"))
    decoded = decode_video(path, [0, 4, 8], 32, 48, rotation=90)
    assert decoded.complete and decoded.frames.shape == (3, 48, 32, 3)
    # the scaler's bicubic and Pillow's agree up to rounding at the edges of the moving shape
    assert np.abs(decoded.frames[0].astype(int) - reference.astype(int)).mean() < 4


def test_a_source_above_the_size_limit_is_skipped_with_its_reason(tmp_path, tiny_spec, monkeypatch):
    make_video(tmp_path, "big_video", width=64, height=48)
    make_image(tmp_path, "big_image", width=64, height=48)
    make_image(tmp_path, "small", width=32, height=16)
    monkeypatch.setattr(media_module, "MAX_SOURCE_PIXELS", 32 * 32)
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    reasons = {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in data.report.skipped}
    assert set(reasons) == {"big_video.mp4", "big_image.png"}
    assert all("64x48" in r and "megapixel limit" in r for r in reasons.values())
    assert [c.path.name for c in data.clips] == ["small.png"]


def test_pillows_decompression_bomb_warning_is_never_raised_through(tmp_path, tiny_spec, monkeypatch):
    make_image(tmp_path, "large", width=64, height=64)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)  # 4096 pixels: Pillow warns (errors above 6000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
        load_image(tmp_path / "large.png", 32, 32)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert [c.path.name for c in data.clips] == ["large.png"]


def test_every_file_is_used_skipped_or_ignored_and_each_is_listed(tmp_path, tiny_spec):
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    make_image(root, "here")
    make_video(elsewhere / "clips", "linked")
    (root / "more").symlink_to(elsewhere / "clips", target_is_directory=True)  # a symlinked subfolder
    (root / "gone.mp4").symlink_to(tmp_path / "deleted.mp4")  # a dangling link
    (root / "gone.txt").write_text("a caption of a link to nothing")
    for name in ("a.xcf", "b.psd", "c.json", "d.doc", "e.zip", "f.mid"):
        (root / name).write_bytes(b"x")
    (root / "orphan.txt").write_text("a caption without a medium")
    (root / ".DS_Store").write_bytes(b"x")
    data = build_dataset(data_config(root), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(c.path.name for c in data.clips) == ["here.png", "linked.mp4"]
    skipped = {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in data.report.skipped}
    assert skipped["gone.mp4"].startswith("broken symbolic link")
    ignored = {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in data.report.ignored_files}
    assert set(ignored) == {"a.xcf", "b.psd", "c.json", "d.doc", "e.zip", "f.mid", "orphan.txt", ".DS_Store"}
    text = data.report.format()
    assert "ignored files: 8" in text and all(f"/{name}: " in text for name in ignored)


def test_a_newline_in_a_file_name_stays_on_its_report_line(tmp_path, tiny_spec):
    make_image(tmp_path, "ok")
    (tmp_path / "two\nlines.mp4").write_bytes(b"")
    (tmp_path / "two\nlines.txt").write_text("x")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    lines = data.report.format().splitlines()
    (line,) = [x for x in lines if "lines.mp4" in x]
    assert "two\\nlines.mp4" in line and line.endswith("empty file (0 bytes)")


def test_gif_and_tiff_images_train_like_png(tmp_path, tiny_spec):
    make_image(tmp_path, "still")
    Image.open(tmp_path / "still.png").save(tmp_path / "anim.gif")
    Image.open(tmp_path / "still.png").save(tmp_path / "scan.tiff")
    for name in ("anim", "scan"):
        (tmp_path / f"{name}.txt").write_text("a blue square")
    data = build_dataset(data_config(tmp_path), spec=tiny_spec, seed=0, batch_size=1)
    assert sorted(c.path.name for c in data.clips) == ["anim.gif", "scan.tiff", "still.png"]
    assert load_image(tmp_path / "scan.tiff", 32, 32).shape == (1, 32, 32, 3)


def test_check_with_nothing_usable_prints_every_skipped_file(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"empty{i}.mp4").write_bytes(b"")
        (data / f"empty{i}.txt").write_text("x")
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\nvariant = "tiny-t2v"\n[data]\npath = "{data}"\n')
    assert main(["check", str(config), "--json", str(tmp_path / "report.json")]) == 2
    out, err = capsys.readouterr()
    assert all(f"empty{i}.mp4: empty file" in out for i in range(3))
    # (the run's structlog warning may precede it when an earlier test configured logging: only the error counts)
    (line,) = [x for x in err.splitlines() if x.startswith("wantrain check: error: ")]
    assert "wantrain check'" not in line and "3 files skipped" in line and "every file is listed above" in line
    assert len(json.loads((tmp_path / "report.json").read_text())["skipped"]) == 3


def test_importing_bitsandbytes_after_wantrain_prints_no_kernel_warning():
    code = "import wantrain.cli.main, bitsandbytes.optim"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    assert "gemm_4bit" not in done.stderr
