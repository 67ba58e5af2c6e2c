"""`wantrain prepare`: scene cuts, clips on the frame buckets, windows, manifests, resume after Ctrl-C, unreadable
inputs named, and what `check` then sees. Every source is made here: solid-colour shots with a moving shape, hard
cuts between them, 64x48 at 24 fps."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from wantrain.cli.main import main
from wantrain.data.demo import render, write_video
from wantrain.data.prepare import PREPARE_DIRNAME, PrepareSettings, manifest_path, prepare_folder
from wantrain.data.prepare_plan import Scene, plan_scene, scene_windows, scenes_from_cuts
from wantrain.data.prepare_scenes import DetectorSettings

# (source frames, shape colour, background) per shot; at 24 fps -> 16 fps: 40 -> 26, 12 -> 8, 30 -> 20, 60 -> 40
SHOTS = [(40, (230, 40, 40), (0, 0, 0)), (12, (240, 240, 240), (200, 30, 200)),
         (30, (40, 200, 70), (90, 90, 90)), (60, (50, 90, 240), (240, 220, 40))]
CUTS = [40, 52, 82]
BUCKETS = (9, 17)
SETTINGS = PrepareSettings(buckets=BUCKETS, fps=16.0, detector=DetectorSettings(min_scene_len=8))


def make_shots(path: Path, shots=SHOTS, fps: float = 24.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.concatenate([render("circle", colour, bg, "left", 64, 48, n) for n, colour, bg in shots])
    write_video(path, pixels, fps)
    return path


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def rate_of(path: Path) -> float:
    with av.open(str(path)) as c:
        return float(c.streams.video[0].average_rate)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    source = root / "raw"
    make_shots(source / "beach" / "day.mp4")
    (source / "stills").mkdir()
    Image.fromarray(render("square", (50, 90, 240), (0, 0, 0), "right", 64, 48, 1)[0]).save(source / "stills" / "a.png")
    (source / "notes.md").write_text("not a video")
    (source / "broken.mp4").write_bytes(b"this is not a video at all")
    (source / "empty.mp4").write_bytes(b"")
    lines: list[str] = []
    summary = prepare_folder(source, root / "clips", SETTINGS, progress=False, log=lines.append)
    return source, root / "clips", summary, lines


def manifests(out: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted((out / PREPARE_DIRNAME / "clips").rglob("*.json"))]
    return [m for m in found if m["kind"] == "video"]


def test_one_scene_per_shot_with_boundaries_within_one_frame(prepared):
    _, out, summary, _ = prepared
    found = sorted({(m["scene_start_frame"], m["scene_end_frame"]) for m in manifests(out)} |
                   {(d["start_frame"], d["end_frame"]) for d in summary.dropped})
    assert summary.scenes == len(SHOTS) == len(found)
    bounds = [0, *CUTS, sum(s[0] for s in SHOTS)]
    for (start, end), (want_start, want_end) in zip(found, zip(bounds[:-1], bounds[1:])):
        assert abs(start - want_start) <= 1 and abs(end - want_end) <= 1


def test_every_clip_lands_on_a_bucket_at_the_training_rate_and_shows_one_shot(prepared):
    _, out, _, _ = prepared
    clips = sorted((out / "beach").glob("*.mp4"))
    assert len(clips) == 5  # 26 frames: 17 + 9; 8: dropped; 20: 17; 40: 17 + 17, tail 6 dropped
    for clip in clips:
        m = json.loads(manifest_path(out, clip).read_text())
        pixels = frames_of(clip)
        assert len(pixels) == m["frames"] == m["bucket"]["frames"] and m["frames"] in BUCKETS
        assert rate_of(clip) == 16.0
        # the background colour (a corner pixel) of the first and last frame is the shot's own
        background = np.array(SHOTS[m["scene"]][2])
        for frame in (pixels[0], pixels[-1]):
            assert np.abs(frame[2, 2].astype(int) - background).max() < 30, (clip.name, frame[2, 2], background)


def test_manifest_names_the_source_times_frames_and_cut_scores(prepared):
    _, out, _, _ = prepared
    m = json.loads(manifest_path(out, out / "beach" / "day_scene002_clip00.mp4").read_text())
    assert m["source"] == "beach/day.mp4" and m["scene"] == 2
    assert abs(m["scene_start_frame"] - 52) <= 1 and m["start_frame"] == m["scene_start_frame"]
    assert m["start_time"] == pytest.approx(m["start_frame"] / 24.0)
    assert m["end_time"] == pytest.approx(m["end_frame"] / 24.0)
    # 17 frames at 16 fps show source frames start .. start + floor(16 * 24 / 16) = start + 24
    assert m["end_frame"] - m["start_frame"] == 25 and m["fps"] == 16.0 and m["source_fps"] == 24.0
    assert m["cut_score"] > 27.0 and m["end_cut_score"] > 27.0
    first = json.loads(manifest_path(out, out / "beach" / "day_scene000_clip00.mp4").read_text())
    assert first["cut_score"] is None


def test_a_scene_shorter_than_the_shortest_bucket_is_named_and_dropped(prepared):
    _, _, summary, _ = prepared
    assert [(d["scene"], d["source"]) for d in summary.dropped] == [(1, "beach/day.mp4")]
    assert "too short: 8 frames at 16 fps (12 at 24 fps); the shortest frame bucket is 9" in summary.format()
    assert "dropped: beach/day.mp4 scene 1 (frames 40-52, 1.67-2.17 s)" in summary.format()


def test_unreadable_inputs_are_named_one_line_each_and_the_rest_is_prepared(prepared):
    source, _, summary, lines = prepared
    assert sorted(u["path"] for u in summary.unreadable) == [str(source / "broken.mp4"), str(source / "empty.mp4")]
    assert [line for line in lines if line.startswith("unreadable: ")] == [
        f"unreadable: {source / 'broken.mp4'}: {summary.unreadable[0]['reason']}",
        f"unreadable: {source / 'empty.mp4'}: empty file (0 bytes)"]
    assert summary.ignored == [str(source / "notes.md")]


def test_an_image_is_copied_as_it_is_with_its_manifest(prepared):
    source, out, summary, _ = prepared
    copied = out / "stills" / "a.png"
    assert copied.read_bytes() == (source / "stills" / "a.png").read_bytes() and summary.images == 1
    assert json.loads(manifest_path(out, copied).read_text())["source"] == "stills/a.png"
    again = prepare_folder(source, out, SETTINGS, progress=False, log=lambda _: None)
    assert again.written == [] and str(copied) in again.kept


def test_windows_tile_a_long_scene_then_the_tail_takes_a_shorter_bucket():
    assert scene_windows(40, [9, 17]) == [(0, 17), (17, 17)]  # tail of 6 holds no bucket
    assert scene_windows(43, [9, 17]) == [(0, 17), (17, 17), (34, 9)]
    assert scene_windows(40, [9, 17], stride=8) == [(0, 17), (8, 17), (16, 17)]  # overlapping; tail of 7
    assert scene_windows(8, [9, 17]) == []
    clips = plan_scene(Scene(index=3, start=100, end=140), "a", source_fps=16.0, fps=16.0, buckets=[9, 17])
    assert [(c.name, c.start_frame, c.end_frame) for c in clips] == [
        ("a_scene003_clip00.mp4", 100, 117), ("a_scene003_clip01.mp4", 117, 134)]
    slow = plan_scene(Scene(index=0, start=0, end=10), "b", source_fps=8.0, fps=16.0, buckets=[9])
    assert slow[0].source_indices == (0, 0, 1, 1, 2, 2, 3, 3, 4)  # a slower source repeats frames


def test_scenes_from_cuts_carry_the_cut_scores():
    scenes = scenes_from_cuts([30, 10, 10, 0, 99], 50, {10: 40.0, 30: 80.0})
    assert [(s.start, s.end, s.cut_score, s.end_score) for s in scenes] == [
        (0, 10, None, 40.0), (10, 30, 40.0, 80.0), (30, 50, 80.0, None)]


def test_an_interrupted_run_keeps_every_finished_clip_and_the_next_run_completes(tmp_path, monkeypatch):
    from wantrain.data import prepare_write

    source = tmp_path / "raw"
    make_shots(source / "a.mp4")
    out = tmp_path / "clips"
    real_add, count = prepare_write.ClipEncoder.add, [0]

    def add(self, frame):
        count[0] += 1
        if count[0] == 20:  # inside the second clip (the first has 17 frames)
            raise KeyboardInterrupt
        real_add(self, frame)

    monkeypatch.setattr(prepare_write.ClipEncoder, "add", add)
    with pytest.raises(KeyboardInterrupt, match=r"stopped \(Ctrl-C\): 1 clips written this time"):
        prepare_folder(source, out, SETTINGS, progress=False, log=lambda _: None)
    monkeypatch.setattr(prepare_write.ClipEncoder, "add", real_add)
    assert [p.name for p in out.rglob("*") if p.is_file() and ".tmp-" in p.name] == []
    first = out / "a_scene000_clip00.mp4"
    assert [p.name for p in out.glob("*.mp4")] == [first.name] and len(frames_of(first)) == 17
    stamp = first.stat().st_mtime_ns
    report = json.loads((out / PREPARE_DIRNAME / "report.json").read_text())
    assert report["stopped"] and report["written"] == [str(first)]

    summary = prepare_folder(source, out, SETTINGS, progress=False, log=lambda _: None)
    assert summary.kept == [str(first)] and len(summary.written) == 4
    assert first.stat().st_mtime_ns == stamp
    again = prepare_folder(source, out, SETTINGS, progress=False, log=lambda _: None)
    assert len(again.kept) == 5 and again.written == []


def test_a_changed_bucket_rewrites_the_clips_it_changes(tmp_path):
    source = tmp_path / "raw"
    make_shots(source / "a.mp4", shots=SHOTS[:1])
    out = tmp_path / "clips"
    prepare_folder(source, out, SETTINGS, progress=False, log=lambda _: None)
    summary = prepare_folder(source, out, PrepareSettings(buckets=(9,), fps=16.0), progress=False,
                             log=lambda _: None)
    assert summary.kept == [] and len(summary.written) == 2  # 26 frames: 9 + 9 (was 17 + 9)
    assert len(frames_of(out / "a_scene000_clip00.mp4")) == 9


def test_the_command_prepares_with_a_configs_buckets_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    source = tmp_path / "raw"
    make_shots(source / "a.mp4", shots=SHOTS[:1])
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n\n[data]\npath = "clips"\nframes = [9]\nfps = 8.0\n')
    assert main(["prepare", str(source), "--config", str(config), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "prepare: 1 videos (0.0 min), 0 images -> 1 clips" in out
    clip = tmp_path / "clips" / "a_scene000_clip00.mp4"  # 40 frames at 24 fps -> 13 at 8 fps: one clip of 9
    assert len(frames_of(clip)) == 9 and rate_of(clip) == 8.0
    assert main(["prepare", str(source), str(tmp_path / "x"), "--frames", "10", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["wantrain prepare: error: frame buckets [10]: give one or more counts of the form 4k+1 "
                   "(5, 9, 17, 33, 81, ...)"]
    assert not (tmp_path / "x").exists()


def test_check_reports_what_each_prepared_clip_became(prepared, tmp_path, capsys):
    import shutil

    _, out, _, _ = prepared
    data = tmp_path / "clips"
    shutil.copytree(out, data)
    clips = sorted(data.glob("beach/*.mp4"))
    for clip in clips[1:]:
        clip.with_suffix(".txt").write_text("ohwx, a shape on a plain background")
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n\n[data]\npath = "clips"\nframes = [9, 17]\nfps = 16.0\n'
                      "resolutions = [32]\n")
    report = tmp_path / "report.json"
    assert main(["check", str(config), "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert f"{clips[0].relative_to(tmp_path)}: no caption file {clips[0].with_suffix('.txt').name}" in text
    assert PREPARE_DIRNAME not in text  # wantrain's own folder, like the cache: not listed
    rep = json.loads(report.read_text())
    # every captioned clip trains whole, on the bucket its manifest names, at the rate it was written at
    retimed = {Path(r["path"]).name: (r["source_frames"], r["frames"], r["source_fps"]) for r in rep["retimed"]}
    for clip in clips[1:]:
        m = json.loads(manifest_path(data, clip).read_text())
        assert retimed[clip.name] == (m["frames"], m["frames"], 16.0)
    assert sorted(b["frames"] for b in rep["buckets"] for _ in range(b["clips"])) == sorted(
        json.loads(manifest_path(data, c).read_text())["frames"] for c in clips[1:])
    assert rep["frames_left_over"] == 0


def test_the_docs_example_prepares_clips_on_its_configs_buckets(tmp_path, capsys, monkeypatch):
    """docs/data.md, From raw footage: its config and its `wantrain prepare` line, as written."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = doc.split("## From raw footage", 1)[1].split("\n## ", 1)[0]
    config = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    command = next(line for line in re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
                   if line.startswith("wantrain prepare"))
    (tmp_path / "my_lora.toml").write_text(config)
    # two shots at 16 fps: 100 frames -> one clip of 81 (the 19 after it hold no bucket); 40 -> one of 33
    make_shots(tmp_path / "footage" / "walk.mp4", shots=[(100, (230, 40, 40), (0, 0, 0)),
                                                          (40, (40, 200, 70), (90, 90, 90))], fps=16.0)
    monkeypatch.chdir(tmp_path)
    assert main([*shlex.split(command)[1:], "--quiet"]) == 0
    assert "-> 2 clips in" in capsys.readouterr().out
    assert sorted((p.name, len(frames_of(p)), rate_of(p)) for p in (tmp_path / "clips").glob("*.mp4")) == [
        ("walk_scene000_clip00.mp4", 81, 16.0), ("walk_scene001_clip00.mp4", 33, 16.0)]


def test_a_phone_videos_clips_keep_its_display_rotation(tmp_path):
    from wantrain.data.media import probe

    source = tmp_path / "phone.mp4"
    pixels = np.concatenate([render("circle", colour, bg, "left", 64, 48, n) for n, colour, bg in SHOTS[:1]])
    write_video(source, pixels, 24.0, rotation=-90)  # portrait, as phones store it
    summary = prepare_folder(source, tmp_path / "clips", SETTINGS, progress=False, log=lambda _: None)
    assert len(summary.written) == 2
    for clip in summary.written:
        info = probe(Path(clip))
        assert (info.rotation, info.width, info.height) == (270, 48, 64) and info.frames in BUCKETS
