"""``wantrain run CONFIG --serve PORT``: the page of the config's output folder in a child process (the browser
test, tests/serve/test_browser.py, watches a run through it)."""

from __future__ import annotations

import argparse
import socket
import time

import httpx

from wantrain.cli.run import start_page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_the_page_of_the_configs_output_folder_in_a_child_process(tmp_path, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text('[run]\noutput_dir = "out"\n[data]\npath = "data"\n', encoding="utf-8")
    (tmp_path / "out" / "20260101_000000").mkdir(parents=True)
    (tmp_path / "out" / "20260101_000000" / "config.toml").write_text('[run]\nname = "x"\n')
    port = free_port()
    monkeypatch.setenv("WANTRAIN_SERVE_TOKEN", "a-fixed-token-of-the-test")  # the child's token: it prints it
    page = start_page(argparse.Namespace(config=config, serve=port), [])
    try:
        deadline, runs = time.monotonic() + 60, None
        while runs is None and time.monotonic() < deadline and page.poll() is None:
            try:
                runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2,
                                 headers={"X-Wantrain-Token": "a-fixed-token-of-the-test"}).json()
            except httpx.HTTPError:
                time.sleep(0.2)
        assert runs is not None and runs["root"] == str((tmp_path / "out").resolve())
        assert [r["id"] for r in runs["runs"]] == ["20260101_000000"]
    finally:
        page.terminate()
        page.wait(timeout=10)


def test_the_page_ends_by_itself_when_the_run_is_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_text('[run]\noutput_dir = "out"\n[data]\npath = "data"\n', encoding="utf-8")
    port = free_port()
    run = subprocess.Popen([sys.executable, "-c", (
        "import argparse, sys, time; from pathlib import Path; from wantrain.cli.run import start_page; "
        f"page = start_page(argparse.Namespace(config=Path({str(config)!r}), serve={port}), []); "
        "print(page.pid, flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    page = int(run.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        run.kill()  # SIGKILL: the run cannot end its page itself
        run.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{page}") and "Z" not in _state(page):
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{page}") or "Z" in _state(page), "the page outlived the killed run"
    finally:
        if os.path.exists(f"/proc/{page}"):
            os.kill(page, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
