"""wantrain serve: what the server reads, what it refuses, and that it stays up (Starlette's test client)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from wantrain.app.serve.rundata import STALE_S, downsample
from wantrain.app.serve.server import Site, build_app
from wantrain.cli.main import main
from wantrain.core.events import ExpertSwitched, MetricsLogged, RunEnded, RunStarted, to_record
from wantrain.core.inbox import INBOX_NAME

LOCAL = "http://127.0.0.1:8765"


def line(event, seq=1):
    return json.dumps(to_record(event, seq, time.time())) + "\n"


def make_run(root: Path, name="20260101_000000", steps=(5, 10), ended=None) -> Path:
    run = root / name
    (run / "samples").mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "demo"\n', encoding="utf-8")
    events = line(RunStarted(step=0, run_dir=str(run), total_steps=100, grad_accum=1,
                             experts=("high_noise", "low_noise"), log_every=5))
    events += line(ExpertSwitched(step=10, previous="high_noise", expert="low_noise"), 2)
    metrics = ""
    for step in steps:
        values = {"train/loss": 1.0 / step, "train/loss/high_noise": 1.0 / step, "train/lr": 1e-4}
        metrics += json.dumps({"step": step, "time": time.time(), "elapsed_s": step * 0.1, "expert": "high_noise",
                               **values}) + "\n"
        events += line(MetricsLogged(step=step, expert="high_noise", values=values, elapsed_s=step * 0.1,
                                     total_steps=100), 3)
    if ended:
        events += line(RunEnded(step=steps[-1], status=ended, reason=None), 9)
    (run / "events.jsonl").write_text(events, encoding="utf-8")
    (run / "metrics.jsonl").write_text(metrics, encoding="utf-8")
    (run / "samples" / "step_000010_00.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    return run


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    make_run(root)
    return Site(root, token="secret-token")


@pytest.fixture
def client(site):
    return TestClient(build_app(site), base_url=LOCAL)


def test_the_runs_list_shows_status_step_eta_and_last_loss(client):
    runs = client.get("/api/runs").json()["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert (run["status"], run["step"], run["total_steps"], run["name"]) == ("running", 10, 100, "demo")
    assert run["last_loss"] == pytest.approx(0.1)
    assert run["eta_s"] == pytest.approx(90 * 0.1)  # 5 steps in 0.5 s since the first row, 90 to go


def test_the_run_page_gets_series_timeline_and_samples(client):
    info = client.get("/api/runs/20260101_000000").json()
    assert info["samples"] == [{"step": 10, "index": 0, "kind": "mp4", "path": "samples/step_000010_00.mp4"}]
    assert info["config"].startswith("[run]")
    series = client.get("/api/runs/20260101_000000/series").json()["series"]
    assert series["train/loss/high_noise"] == {"x": [5.0, 10.0], "y": [0.2, 0.1]}
    poll = client.get("/api/runs/20260101_000000/poll?m=0&e=0").json()
    assert [e["type"] for e in poll["events"]] == ["RunStarted", "ExpertSwitched"]  # metrics are the charts'
    assert client.get("/api/runs/20260101_000000/series").json()["switches"] == [10]
    assert client.get("/files/20260101_000000/samples/step_000010_00.mp4").content.startswith(b"\x00\x00\x00\x18")


def test_a_value_that_is_not_a_number_is_left_out_and_a_blank_line_skipped(client, site):
    with (site.root / "20260101_000000" / "metrics.jsonl").open("a") as fh:
        fh.write("\n" + json.dumps({"step": 15, "train/loss": "oops", "train/lr": 2e-4}) + "\n")  # and a blank line
    series = client.get("/api/runs/20260101_000000/series").json()["series"]
    assert series["train/loss"]["x"] == [5.0, 10.0] and series["train/lr"]["x"] == [5.0, 10.0, 15.0]


def test_a_live_poll_returns_only_what_was_written_since(client, site):
    first = client.get("/api/runs/20260101_000000/poll?m=0&e=0").json()
    with (site.root / "20260101_000000" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 15, "train/loss": 0.05}) + "\n")
    later = client.get(f"/api/runs/20260101_000000/poll?m={first['rows']}&e={first['event_count']}").json()
    assert later["points"] == {"train/loss": {"x": [15.0], "y": [0.05]}}
    assert later["events"] == []


@pytest.mark.parametrize("path", [
    "/files/20260101_000000/..%2F..%2Fsecret.txt",
    "/files/20260101_000000/%2E%2E/%2E%2E/secret.txt",
    "/files/20260101_000000//etc/passwd",
    "/files/..%2Fsecret.txt/x",
    "/api/runs/..",
    "/api/runs/%2E%2E",
])
def test_a_path_outside_the_output_folder_is_refused_and_the_server_stays_up(client, site, path):
    (site.root.parent / "secret.txt").write_text("the secret")
    response = client.get(path)
    assert response.status_code in (404, 405) and "the secret" not in response.text
    assert client.get("/api/runs").status_code == 200


def test_a_symlink_that_leads_outside_is_refused(client, site, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    run = site.root / "20260101_000000"
    os.symlink(secret, run / "samples" / "step_000020_00.mp4")
    os.symlink(tmp_path, site.root / "20260102_000000")  # a run directory that is a link elsewhere
    response = client.get("/files/20260101_000000/samples/step_000020_00.mp4")
    assert response.status_code == 404 and "the secret" not in response.text
    assert client.get("/api/runs/20260102_000000").status_code == 404
    assert [r["id"] for r in client.get("/api/runs").json()["runs"]] == ["20260101_000000"]


def test_a_control_without_the_token_or_from_another_origin_is_refused(client, site):
    inbox = site.root / "20260101_000000" / INBOX_NAME
    url = "/api/runs/20260101_000000/control"
    evil = {"Origin": "http://evil.example"}
    assert client.post(url, json={"action": "stop"}, headers=evil).status_code == 403
    assert client.post(url, json={"action": "stop"}).status_code == 403  # same origin, no token
    refused = client.post(url, json={"action": "stop"}, headers={**evil, "X-Wantrain-Token": "secret-token"})
    assert refused.status_code == 403 and "another origin" in refused.json()["error"]
    assert not inbox.exists()
    ok = client.post(url, json={"action": "save"}, headers={"X-Wantrain-Token": "secret-token", "Origin": LOCAL})
    assert ok.status_code == 200
    assert [json.loads(x)["action"] for x in inbox.read_text().splitlines()] == ["save"]
    assert json.loads(inbox.read_text())["source"] == "web"


def test_a_control_to_an_ended_run_or_a_read_only_server_is_refused(site, tmp_path):
    make_run(site.root, "20260103_000000", ended="completed")
    client = TestClient(build_app(site), base_url=LOCAL)
    headers = {"X-Wantrain-Token": "secret-token"}
    ended = client.post("/api/runs/20260103_000000/control", json={"action": "save"}, headers=headers)
    assert ended.status_code == 409 and "has ended (completed)" in ended.json()["error"]
    read_only = TestClient(build_app(Site(site.root, token="secret-token", read_only=True)), base_url=LOCAL)
    refused = read_only.post("/api/runs/20260101_000000/control", json={"action": "save"}, headers=headers)
    assert refused.status_code == 403 and "read-only" in refused.json()["error"]
    assert not (site.root / "20260101_000000" / INBOX_NAME).exists()


def test_a_request_naming_another_host_is_refused_on_a_local_server(site):
    client = TestClient(build_app(site), base_url="http://attacker.example:8765")  # DNS rebinding
    response = client.get("/api/runs")
    assert response.status_code == 403 and "127.0.0.1 and localhost only" in response.json()["error"]


def test_a_server_on_another_address_needs_the_token_for_every_request(site):
    remote = Site(site.root, token="secret-token", local_only=False)
    client = TestClient(build_app(remote), base_url="http://10.0.0.5:8765")
    assert client.get("/api/runs").status_code == 403
    assert client.get("/files/20260101_000000/samples/step_000010_00.mp4").status_code == 403
    opened = client.get("/?token=secret-token", follow_redirects=False)
    assert opened.status_code == 303 and "wantrain_token=secret-token" in opened.headers["set-cookie"]
    assert client.get("/api/runs", cookies={"wantrain_token": "secret-token"}).status_code == 200
    assert client.get("/api/runs", headers={"X-Wantrain-Token": "wrong"}).status_code == 403


def test_the_page_served_to_this_machine_embeds_the_token(client):
    page = client.get("/").text
    assert '<meta name="wantrain-token" content="secret-token">' in page
    assert client.get("/static/vendor/uplot/uPlot.iife.min.js").status_code == 200


def test_a_torn_last_line_in_the_event_log_is_left_out_and_said_plainly(client, site):
    run = site.root / "20260101_000000"
    with (run / "events.jsonl").open("a") as fh:
        fh.write('{"step":10,"status":"failed","_ty')  # a kill while the line was written
    old = time.time() - STALE_S - 10
    for name in ("events.jsonl", "metrics.jsonl"):
        os.utime(run / name, (old, old))
    poll = client.get("/api/runs/20260101_000000/poll?m=0&e=0").json()
    assert len(poll["events"]) == 2 and poll["summary"]["status"] == "interrupted"
    assert any("events.jsonl: the last line is incomplete" in p for p in poll["summary"]["problems"])
    with (run / "events.jsonl").open("a") as fh:
        fh.write('pe":"RunEnded","reason":"x","seq":9,"wall_time":1.0,"schema":1}\n{"_type":"ObserverFailed",garbled\n')
    poll = client.get("/api/runs/20260101_000000/poll?m=0&e=2").json()
    assert [e["type"] for e in poll["events"]] == ["RunEnded"] and poll["summary"]["status"] == "failed"
    assert "events.jsonl: 1 line(s) are not JSON and were skipped" in poll["summary"]["problems"]


def test_a_gzip_event_log_is_read_too_and_a_torn_member_is_left_out(client, site):
    import gzip

    run = site.root / "20260101_000000"
    events = (run / "events.jsonl").read_bytes()
    (run / "events.jsonl").unlink()
    (run / "events.jsonl.gz").write_bytes(gzip.compress(events))
    fresh = TestClient(build_app(Site(site.root, token="t")), base_url=LOCAL)
    poll = fresh.get("/api/runs/20260101_000000/poll?m=0&e=0").json()
    assert [e["type"] for e in poll["events"]] == ["RunStarted", "ExpertSwitched"]
    ended = line(RunEnded(step=10, status="stopped", reason="requested (web)"), 9).encode()
    with (run / "events.jsonl.gz").open("ab") as fh:
        fh.write(gzip.compress(ended))
        fh.write(gzip.compress(b'{"_type":"RunStarted"')[:20])  # a member cut off by a kill
    poll = fresh.get("/api/runs/20260101_000000/poll?m=0&e=2").json()
    assert [e["type"] for e in poll["events"]] == ["RunEnded"] and poll["summary"]["status"] == "stopped"


def test_a_run_directory_deleted_while_open_is_said_plainly(client, site):
    assert client.get("/api/runs/20260101_000000/poll").status_code == 200
    shutil.rmtree(site.root / "20260101_000000")
    gone = client.get("/api/runs/20260101_000000/poll")
    assert gone.status_code == 404 and "no run '20260101_000000'" in gone.json()["error"]
    assert client.get("/api/runs").json()["runs"] == []


def test_downsampling_keeps_the_spikes_and_the_order():
    x = list(range(100_000))
    y = list(np.sin(np.arange(100_000) / 5000.0))
    y[54_321] = 50.0
    y[7] = None
    out = downsample(x, y, 2000)
    assert len(out["x"]) <= 2000 and out["x"].tolist() == sorted(out["x"])
    assert 54_321 in out["x"] and max(out["y"]) == 50.0 and 7 not in out["x"]
    zoomed = downsample(x, y, 2000, lo=1000, hi=1999)
    assert zoomed["x"].tolist() == [float(v) for v in range(1000, 2000)]


def test_wantrain_ctl_asks_a_running_run_and_refuses_an_ended_one(site, capsys):
    run = site.root / "20260101_000000"
    assert main(["ctl", str(run), "sample"]) == 0
    assert json.loads((run / INBOX_NAME).read_text())["action"] == "sample"
    ended = make_run(site.root, "20260103_000000", ended="stopped")
    assert main(["ctl", str(ended), "stop"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"wantrain ctl: error: the run in {ended} has ended (stopped); nothing can be asked of it"]


def test_wantrain_serve_refuses_a_missing_folder_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
