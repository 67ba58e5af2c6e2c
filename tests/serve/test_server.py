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
from wantrain.core.inbox import ACTIONS, INBOX_NAME

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


def client_of(site, base_url=LOCAL):
    """A client that opened the printed URL: it holds the server's cookie."""
    return TestClient(build_app(site), base_url=base_url, cookies={site.cookie: site.token})


@pytest.fixture
def client(site):
    return client_of(site)


def test_the_runs_list_shows_status_step_eta_and_last_loss(client):
    runs = client.get("/api/runs").json()["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert (run["status"], run["step"], run["total_steps"], run["name"]) == ("running", 10, 100, "demo")
    assert run["last_loss"] == pytest.approx(0.1)
    assert run["eta_s"] == pytest.approx(90 * 0.1)  # 5 steps in 0.5 s since the first row, 90 to go


def test_the_run_page_gets_series_timeline_and_samples(client):
    info = client.get("/api/runs/20260101_000000").json()
    assert info["samples"] == [{"step": 10, "index": 0, "kind": "mp4", "path": "samples/step_000010_00.mp4",
                                "prompt": None}]
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


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"act": "save"}', b'{"action": ["save"]}'])
def test_a_control_or_caption_whose_body_is_not_the_json_object_expected_is_refused_with_its_shape(client, site, body):
    headers = {"X-Wantrain-Token": "secret-token", "Content-Type": "application/json"}
    control = client.post("/api/runs/20260101_000000/control", content=body, headers=headers)
    assert control.status_code == 400, control.text
    assert control.json()["error"] in ('the body must be JSON {"action": ...}', "unknown action ['save']: use one of "
                                       + ", ".join(ACTIONS))
    caption = client.post("/api/data/caption", content=body, headers=headers)
    assert caption.status_code == 400 and caption.json()["error"].startswith("the body must be JSON {"), caption.text
    assert not (site.root / "20260101_000000" / INBOX_NAME).exists()


def test_a_control_to_an_ended_run_or_a_read_only_server_is_refused(site, tmp_path):
    make_run(site.root, "20260103_000000", ended="completed")
    client = client_of(site)
    headers = {"X-Wantrain-Token": "secret-token"}
    ended = client.post("/api/runs/20260103_000000/control", json={"action": "save"}, headers=headers)
    assert ended.status_code == 409 and "has ended (completed)" in ended.json()["error"]
    read_only = client_of(Site(site.root, token="secret-token", read_only=True))
    refused = read_only.post("/api/runs/20260101_000000/control", json={"action": "save"}, headers=headers)
    assert refused.status_code == 403 and "read-only" in refused.json()["error"]
    assert not (site.root / "20260101_000000" / INBOX_NAME).exists()


def test_a_request_naming_another_host_is_refused_on_a_local_server(site):
    client = TestClient(build_app(site), base_url="http://attacker.example:8765")  # DNS rebinding
    response = client.get("/api/runs")
    assert response.status_code == 403 and "answers 127.0.0.1, ::1, [::1], localhost only" in response.json()["error"]


def test_a_server_on_another_address_needs_the_token_for_every_request(site):
    remote = Site(site.root, token="secret-token", local_only=False)
    client = TestClient(build_app(remote), base_url="http://10.0.0.5:8765")
    assert client.get("/api/runs").status_code == 403
    assert client.get("/files/20260101_000000/samples/step_000010_00.mp4").status_code == 403
    opened = client.get("/?token=secret-token", follow_redirects=False)
    assert opened.status_code == 303 and f"{remote.cookie}=secret-token" in opened.headers["set-cookie"]
    assert client.get("/api/runs", cookies={remote.cookie: "secret-token"}).status_code == 200
    assert client.get("/api/runs", headers={"X-Wantrain-Token": "wrong"}).status_code == 403


def test_on_loopback_too_the_page_data_and_files_need_the_token(site):
    stranger = TestClient(build_app(site), base_url=LOCAL)  # another user of this machine: no token, no cookie
    for path in ("/", "/api/runs", "/api/runs/20260101_000000/poll", "/files/20260101_000000/config.toml"):
        response = stranger.get(path)
        assert response.status_code == 403 and "secret-token" not in response.text, path
    assert stranger.get("/static/vendor/uplot/uPlot.iife.min.js").status_code == 200  # code, nothing of a run
    opened = stranger.get("/?token=secret-token", follow_redirects=False)
    assert opened.status_code == 303 and f"{site.cookie}=secret-token" in opened.headers["set-cookie"]
    assert "HttpOnly" in opened.headers["set-cookie"] and "SameSite=strict" in opened.headers["set-cookie"]
    page = client_of(site).get("/").text  # the owner, with the cookie: the page carries the token for controls
    assert '<meta name="wantrain-token" content="secret-token">' in page
    assert site.cookie != Site(site.root, token="other").cookie  # two servers on two ports keep their cookies apart


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
    fresh = client_of(Site(site.root, token="t"))
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


def metrics_rows(steps):
    return "".join(json.dumps({"step": s, "train/loss": 1.0 / s, "train/lr": 1e-4}) + "\n" for s in steps)


def test_a_resume_that_cuts_the_logs_back_shows_each_step_once_in_order(client, site):
    from wantrain.core.events.log import cut_back

    run = site.root / "20260101_000000"
    name = run.name
    (run / "metrics.jsonl").write_text(metrics_rows(range(5, 101, 5)))
    first = client.get(f"/api/runs/{name}/poll?m=0&e=0").json()
    assert first["rows"] == 20
    cut_back(run / "metrics.jsonl", 50)  # a resume from step 50, seen before the run wrote again
    cut_back(run / "events.jsonl", 50)
    poll = client.get(f"/api/runs/{name}/poll?m={first['rows']}&e={first['event_count']}").json()
    x = client.get(f"/api/runs/{name}/series").json()["series"]["train/loss"]["x"]
    assert x == [float(s) for s in range(5, 51, 5)]  # was 5..100 then 5..50 again: 150 rows
    assert poll["generation"] == first.get("generation", 0) + 1  # the page reloads the run
    cut_back(run / "metrics.jsonl", 30)  # a second resume, and the run grows past the old size before a look
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write(metrics_rows(range(35, 301, 5)))
    x = client.get(f"/api/runs/{name}/series").json()["series"]["train/loss"]["x"]
    assert x == [float(s) for s in range(5, 301, 5)]  # was: 55..100 missing, a step read twice
    events = client.get(f"/api/runs/{name}/poll?m=0&e=0").json()["events"]
    assert [e["type"] for e in events] == ["RunStarted", "ExpertSwitched"]  # each once


def test_a_gzip_poll_reads_only_what_was_appended(site, monkeypatch):
    import gzip
    import zlib

    fed = []
    real = zlib.decompressobj

    class Counting:  # what every reader of a gzip log decompresses, counted
        def __init__(self, *args, **kwargs):
            self._d = real(*args, **kwargs)

        def decompress(self, data, *args):
            fed.append(len(data))
            return self._d.decompress(data, *args)

        def __getattr__(self, name):
            return getattr(self._d, name)

    monkeypatch.setattr(zlib, "decompressobj", Counting)
    run = site.root / "20260101_000000"
    events = (run / "events.jsonl").read_bytes()
    (run / "events.jsonl").unlink()
    filler = line(RunEnded(step=1, status="completed", reason=None)).replace("RunEnded", "Filler").encode()
    with gzip.open(run / "events.jsonl.gz", "wb") as fh:  # a long run: 20k lines, a member per 1000 as written
        fh.write(events)
        for _ in range(20):
            fh.write(filler * 1000)
            fh.flush()
    client = client_of(site)
    first = client.get("/api/runs/20260101_000000/poll?m=0&e=0").json()
    size = (run / "events.jsonl.gz").stat().st_size
    appended = gzip.compress(line(RunEnded(step=10, status="stopped", reason="requested (web)"), 9).encode())
    with (run / "events.jsonl.gz").open("ab") as fh:
        fh.write(appended)
    fed.clear()
    poll = client.get(f"/api/runs/20260101_000000/poll?m=0&e={first['event_count']}").json()
    assert poll["summary"]["status"] == "stopped"
    assert sum(fed) <= len(appended) < size // 10  # was: the whole file again at every poll


def test_a_slow_first_read_does_not_hold_up_the_runs_list_or_the_page(site, monkeypatch):
    import threading

    import httpx

    from wantrain.app.serve import PageServer
    from wantrain.app.serve.rundata import JsonlTail

    big = make_run(site.root, "20260105_000000")
    release, reading = threading.Event(), threading.Event()
    real = JsonlTail.read

    def slow(self):
        if self.path.parent == big and not release.is_set():
            reading.set()
            release.wait(30)  # the first read of a huge run
        return real(self)

    monkeypatch.setattr(JsonlTail, "read", slow)
    monkeypatch.setenv("WANTRAIN_SERVE_TOKEN", "secret-token")
    server = PageServer(site.root, port=0).start()
    headers = {"X-Wantrain-Token": "secret-token"}
    try:
        opened = []
        thread = threading.Thread(target=lambda: opened.append(
            httpx.get(f"{server.url}api/runs/{big.name}", headers=headers, timeout=60)))
        thread.start()
        assert reading.wait(10)
        runs = httpx.get(f"{server.url}api/runs", headers=headers, timeout=5).json()["runs"]  # was: a hang
        assert {r["id"]: r["status"] for r in runs} == {"20260105_000000": "reading", "20260101_000000": "running"}
        assert httpx.get(f"{server.url}static/app.css", timeout=5).status_code == 200
        release.set()
        thread.join(30)
        assert opened[0].status_code == 200 and opened[0].json()["summary"]["status"] == "running"
    finally:
        release.set()
        server.stop()


def test_a_loopback_alias_is_served(site, monkeypatch):
    import httpx

    from wantrain.app.serve import PageServer

    monkeypatch.setenv("WANTRAIN_SERVE_TOKEN", "secret-token")
    server = PageServer(site.root, host="127.0.0.2", port=0).start()
    try:  # it counts as local (the Host check), so its own address must pass that check
        response = httpx.get(f"{server.url}api/runs", headers={"X-Wantrain-Token": "secret-token"}, timeout=10)
        assert response.status_code == 200 and response.json()["runs"][0]["id"] == "20260101_000000"
    finally:
        server.stop()


@pytest.mark.parametrize("compressed", [False, True])
def test_wantrain_ctl_finds_the_end_of_the_last_start_from_the_end_of_the_log(site, compressed):
    import gzip

    from wantrain.app.serve.rundata import ended_record

    run = site.root / "20260101_000000"
    log = (run / "events.jsonl").read_text()
    filler = line(ExpertSwitched(step=11, previous="a", expert="b")) * 2000  # > 64 KiB: more than one window
    ended = line(RunEnded(step=10, status="stopped", reason=None))
    started = line(RunStarted(step=10, run_dir=str(run), total_steps=100, grad_accum=1, experts=("a",),
                              log_every=5, resumed_from="x"))

    def write(text):
        if compressed:
            (run / "events.jsonl").unlink(missing_ok=True)
            (run / "events.jsonl.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (run / "events.jsonl").write_text(text)

    write(log + filler)
    assert ended_record(run) is None
    write(log + filler + ended + filler)
    assert ended_record(run)["status"] == "stopped"
    write(log + ended + started + filler)  # resumed after it ended: running again
    assert ended_record(run) is None
    write(log + filler + ended[:-10])  # a torn RunEnded: not an end yet
    assert ended_record(run) is None


def test_a_short_fixed_token_is_refused_in_one_line(site, monkeypatch, capsys):
    monkeypatch.setenv("WANTRAIN_SERVE_TOKEN", "1234")
    assert main(["serve", str(site.root), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("has 4 characters: use at least 16 (whoever guesses it can "
                                                    "stop the runs), or unset it for a random token")


def test_a_control_uses_what_the_server_has_read_not_a_fresh_read_of_the_logs(client, site, monkeypatch):
    run = site.root / "20260101_000000"
    (run / "metrics.jsonl").write_text(metrics_rows(range(1, 2001)))  # ~100 KB
    client.get("/api/runs/20260101_000000/poll?m=0&e=0")
    read = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(n) or real(fd, n, offset))
    ok = client.post("/api/runs/20260101_000000/control", json={"action": "save"},
                     headers={"X-Wantrain-Token": "secret-token", "Origin": LOCAL})
    assert ok.status_code == 200
    assert sum(read) < 10_000  # the head checks of the logs; was a new reader parsing both logs whole


def test_an_inbox_this_server_may_not_write_is_a_403_that_says_why(client, monkeypatch):
    import errno

    from wantrain.app.serve import rundata

    def refused(run_dir, action, source):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(rundata, "post_request", refused)  # another user's run folder
    response = client.post("/api/runs/20260101_000000/control", json={"action": "stop"},
                           headers={"X-Wantrain-Token": "secret-token", "Origin": LOCAL})
    assert response.status_code == 403
    assert response.json()["error"].startswith("this server may not write the run's inbox (Permission denied)")
