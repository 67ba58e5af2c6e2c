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


def test_serve_starts_the_page_of_the_configs_output_folder_in_a_child_process(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[run]\noutput_dir = "out"\n[data]\npath = "data"\n', encoding="utf-8")
    (tmp_path / "out" / "20260101_000000").mkdir(parents=True)
    (tmp_path / "out" / "20260101_000000" / "config.toml").write_text('[run]\nname = "x"\n')
    port = free_port()
    page = start_page(argparse.Namespace(config=config, serve=port), [])
    try:
        deadline, runs = time.monotonic() + 60, None
        while runs is None and time.monotonic() < deadline and page.poll() is None:
            try:
                runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2).json()
            except httpx.HTTPError:
                time.sleep(0.2)
        assert runs is not None and runs["root"] == str((tmp_path / "out").resolve())
        assert [r["id"] for r in runs["runs"]] == ["20260101_000000"]
    finally:
        page.terminate()
        page.wait(timeout=10)
