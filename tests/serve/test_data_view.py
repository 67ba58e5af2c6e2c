"""The page's data view (Starlette's test client): a run's clips and a prepared folder's, each with a strip of
frames and its caption; a caption saved atomically only with the token header; names outside the folder refused;
and a caption edited on the page is named as changed data by the fingerprints a resume compares."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient

from wantrain.app.serve.server import Site, build_app
from wantrain.data.demo import render, write_video
from wantrain.data.prepare import PrepareSettings, prepare_folder

LOCAL = "http://127.0.0.1:8765"
TOKEN = "secret-token"


def prepared_folder(root: Path) -> Path:
    """Two shots (26 + 20 frames at 16 fps after retiming) prepared into clips of 9 and 17 frames."""
    pixels = np.concatenate([render("circle", (230, 40, 40), (0, 0, 0), "left", 64, 48, 40),
                             render("square", (40, 200, 70), (90, 90, 90), "right", 64, 48, 30)])
    (root / "raw").mkdir(parents=True)
    write_video(root / "raw" / "shots.mp4", pixels, 24.0)
    out = root / "clips"
    prepare_folder(root / "raw", out, PrepareSettings(buckets=(9, 17), fps=16.0), progress=False, log=lambda _: None)
    return out


@pytest.fixture
def setup(tmp_path):
    clips = prepared_folder(tmp_path)
    (clips / "shots_scene000_clip00.txt").write_text("ohwx, a red circle\n")
    runs = tmp_path / "runs"
    run = runs / "20260101_000000"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(f'[run]\nname = "demo"\n\n[data]\npath = "{clips}"\n')
    site = Site(runs, token=TOKEN, data=(clips,))
    client = TestClient(build_app(site), base_url=LOCAL, cookies={site.cookie: TOKEN})
    return site, client, clips, run


def test_a_runs_clips_are_listed_with_captions_and_manifest_facts(setup):
    _, client, clips, run = setup
    body = client.get(f"/api/data?run={run.name}").json()
    (folder,) = body["folders"]
    assert folder["path"] == str(clips)
    listed = {c["clip"]: c for c in folder["clips"]}
    assert sorted(listed) == ["shots_scene000_clip00.mp4", "shots_scene000_clip01.mp4", "shots_scene001_clip00.mp4"]
    first = listed["shots_scene000_clip00.mp4"]
    assert first["caption"] == "ohwx, a red circle\n" and listed["shots_scene001_clip00.mp4"]["caption"] is None
    assert first["manifest"]["source"] == "shots.mp4" and first["manifest"]["frames"] == 17
    assert client.get("/api/data?folder=0").json()["folders"][0]["clips"] == folder["clips"]
    assert client.get("/api/runs").json()["data"] == [str(clips)]


def test_a_strip_shows_six_frames_of_the_clip(setup):
    _, client, _, run = setup
    res = client.get(f"/api/data/strip?run={run.name}&f=0&clip=shots_scene001_clip00.mp4")
    assert res.status_code == 200 and res.headers["content-type"] == "image/jpeg"
    strip = Image.open(io.BytesIO(res.content))
    assert strip.height == 72 and strip.width == 6 * 96 + 5 * 2  # 64x48 frames at 72 pixels high, 2-pixel gaps
    assert np.asarray(strip)[3, 3].tolist() == pytest.approx([90, 90, 90], abs=12)  # the grey shot's background


def test_a_caption_is_saved_only_with_the_token_header_and_only_for_a_clip_of_the_folder(setup):
    site, client, clips, run = setup
    body = {"run": run.name, "f": 0, "clip": "shots_scene001_clip00.mp4", "text": "  ohwx, a green square  "}
    assert client.post("/api/data/caption", json=body).status_code == 403  # the cookie alone does not do
    assert not (clips / "shots_scene001_clip00.txt").exists()
    res = client.post("/api/data/caption", json=body, headers={"X-Wantrain-Token": TOKEN})
    assert res.status_code == 200, res.text
    assert (clips / "shots_scene001_clip00.txt").read_text() == "ohwx, a green square\n"
    assert [p.name for p in clips.iterdir() if ".tmp-" in p.name] == []
    for clip in ("../runs/20260101_000000/config.toml", "shots_scene000_clip00.txt", ".wantrain_prepare/report.json",
                 "/etc/passwd", "nothing.mp4"):
        res = client.post("/api/data/caption", json={**body, "clip": clip}, headers={"X-Wantrain-Token": TOKEN})
        assert res.status_code == 404, clip
    other = client.post("/api/data/caption", json=body, headers={"X-Wantrain-Token": TOKEN,
                                                                 "Origin": "http://evil.example"})
    assert other.status_code == 403
    site.read_only = True
    assert client.post("/api/data/caption", json=body, headers={"X-Wantrain-Token": TOKEN}).status_code == 403


def test_a_caption_edited_on_the_page_is_named_by_the_fingerprints_a_resume_compares(setup):
    from wantrain.data.config import DataConfig
    from wantrain.data.dataset import build_dataset
    from wantrain.data.fingerprints import caption_files, compare, file_fingerprints
    from wantrain.models.wan22.variants import variant_spec

    _, client, clips, run = setup
    cfg = DataConfig(path=clips, frames=[9, 17], fps=16.0, resolutions=[32], missing_caption="empty")

    def fingerprints():
        data = build_dataset(cfg, spec=variant_spec("tiny-t2v"), seed=0, batch_size=1, warn_skipped=False)
        return file_fingerprints(data.clips), caption_files(data.clips)

    saved, _ = fingerprints()
    body = {"run": run.name, "f": 0, "clip": "shots_scene000_clip00.mp4", "text": "ohwx, a red circle, edited"}
    assert client.post("/api/data/caption", json=body, headers={"X-Wantrain-Token": TOKEN}).status_code == 200
    now, captions = fingerprints()
    difference = compare(json.loads(json.dumps(saved)), now, captions)  # as a checkpoint's state.json holds them
    assert difference.changed == (f"{clips / 'shots_scene000_clip00.txt'} (caption of shots_scene000_clip00.mp4)",)


def test_serve_refuses_a_missing_data_folder_in_one_line(tmp_path, capsys):
    from wantrain.cli.main import main

    assert main(["serve", str(tmp_path), "--data", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"wantrain serve: error: --data folder '{tmp_path / 'nowhere'}' does not exist: give a folder of "
                   "clips (wantrain prepare's)"]
