"""Metadata datasets: a JSONL or CSV file lists the media (relative to it), their captions and per-item repeats;
every line that cannot be used is named in the report with its line number and the reason."""

from __future__ import annotations

import json

import pytest
from conftest import CountingEncoders, datasets_config, make_image, make_video

from wantrain.core.errors import ConfigError, UserError
from wantrain.data import build_dataset, ensure_cache
from wantrain.data.config import DataConfig


def _media(root):
    make_video(root / "clips", "v0", frames=9, caption=None)
    make_image(root / "stills", "i0", caption=None)
    make_image(root / "stills", "i1", caption=None)


def test_a_jsonl_dataset_trains_its_media_with_their_captions_and_repeats(tmp_path, tiny_spec):
    _media(tmp_path)
    lines = [{"video": "clips/v0.mp4", "caption": "a red circle"},
             {"path": "stills/i0.png", "caption": ["a blue square", "blue, square"], "repeats": 3},
             {"image_path": "stills/i1.png", "prompt": "another square"}]
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = DataConfig(metadata=tmp_path / "list.jsonl", resolutions=[32], frames=[9])
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    by_name = {c.path.name: c for c in data.clips}
    assert by_name["v0.mp4"].texts == ("a red circle",) and by_name["v0.mp4"].repeats == 1
    assert by_name["i0.png"].texts == ("a blue square", "blue, square") and by_name["i0.png"].repeats == 3
    assert by_name["i1.png"].texts == ("another square",)
    assert data.report.skipped == [] and data.report.steps_per_epoch == 5
    enc = CountingEncoders()
    stats = ensure_cache(data, enc)
    assert (stats.latents_encoded, stats.texts_encoded) == (3, 4)
    filled = enc.calls
    batch = next(data.batches(enc))
    assert batch["latents"].shape[0] == 1 and enc.calls == filled  # read from the cache
    assert (tmp_path / ".wantrain_cache" / "latents").is_dir()  # next to the metadata file


def test_bad_jsonl_lines_are_named_with_their_line_numbers_and_reasons(tmp_path, tiny_spec):
    _media(tmp_path)
    (tmp_path / "list.jsonl").write_text("\n".join([
        json.dumps({"path": "stills/i0.png", "caption": "fine"}),
        "{not json",
        json.dumps({"caption": "no medium"}),
        "",
        json.dumps({"path": "stills/missing.png", "caption": "gone"}),
        json.dumps({"path": "stills/i1.png", "caption": "bad repeats", "repeats": 0}),
        json.dumps({"path": "stills/i1.png"}),
        json.dumps(["a list"]),
        json.dumps({"path": "list.jsonl", "caption": "not media"}),
    ]) + "\n")
    data = build_dataset(DataConfig(metadata=tmp_path / "list.jsonl", resolutions=[32], frames=[9]), spec=tiny_spec,
                         seed=0, batch_size=1)
    assert [c.path.name for c in data.clips] == ["i0.png"]
    reasons = {s["path"].rsplit(":", 1)[1]: s["reason"] for s in data.report.skipped}
    assert sorted(reasons, key=int) == ["2", "3", "5", "6", "7", "8", "9"]
    assert reasons["2"].startswith("line 2: not a JSON object")
    assert reasons["3"].startswith("line 3: no medium")
    assert reasons["5"] == f"line 5: {tmp_path / 'stills' / 'missing.png'} does not exist"
    assert reasons["6"] == "line 6: 'repeats' = 0 must be at least 1"
    assert reasons["7"].startswith("the line has no caption")
    assert reasons["8"] == "line 8: a JSON list, not an object"
    assert reasons["9"] == "line 9: list.jsonl is not a supported image or video"
    text = data.report.format()
    assert f"{tmp_path / 'list.jsonl'}:2: line 2: not a JSON object" in text


def test_a_csv_dataset_with_bad_rows(tmp_path, tiny_spec):
    _media(tmp_path)
    (tmp_path / "metadata.csv").write_text(
        'video,prompt,repeats\n'
        'clips/v0.mp4,"a red circle, moving left",2\n'
        'stills/i0.png,a blue square,two\n'
        'stills/i1.png,a square,1,extra\n'
    )
    cfg = datasets_config({"metadata": tmp_path / "metadata.csv"}, resolutions=[32], frames=[9])
    data = build_dataset(cfg, spec=tiny_spec, seed=0, batch_size=1)
    assert [(c.path.name, c.caption, c.repeats) for c in data.clips] == [("v0.mp4", "a red circle, moving left", 2)]
    assert [s["reason"] for s in data.report.skipped] == [
        "line 3: 'repeats' = 'two' is not a whole number", "line 4: 4 columns, the header has 3"]


def test_metadata_and_folder_keys_are_one_or_the_other(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of 'path'"):
        datasets_config({"path": tmp_path, "metadata": tmp_path / "a.jsonl"})
    with pytest.raises(ConfigError, match="neither a .jsonl nor a .csv"):
        DataConfig(metadata=tmp_path / "a.txt")
    with pytest.raises(ConfigError, match="'data.metadata' is set with 'data.path'"):
        DataConfig(metadata=tmp_path / "a.jsonl", path=tmp_path)


def test_a_missing_metadata_file_is_one_line(tmp_path, tiny_spec):
    with pytest.raises(UserError, match="metadata file '.*nope.jsonl' does not exist"):
        build_dataset(DataConfig(metadata=tmp_path / "nope.jsonl"), spec=tiny_spec, seed=0, batch_size=1)
