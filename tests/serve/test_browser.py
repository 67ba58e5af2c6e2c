"""wantrain serve in a real browser (Debian's headless Chromium driven by selenium): a person starts the quickstart
and the page of its output folder, watches it train, presses "save now" and sees the checkpoint appear,
presses "stop" and sees the run end resumable.

Set ``WANTRAIN_SCREENSHOTS=docs/img`` to keep the run page's screenshot there (docs/serve.md, the README)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import prewarmed
import pytest

from wantrain.app.serve import PageServer

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
                       reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
                              "apt-get install chromium chromium-driver)"),
]


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1700",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    # the system driver: selenium-manager never downloads anything
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(condition, timeout=120.0, what="the page", process=None):
    """``condition()`` once it is true; an AssertionError after ``timeout`` seconds, or at once when ``process``
    (the training run) has ended without it."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended ({process.returncode}) before {what}")
        try:
            value = condition()
        except StaleElementReferenceException:  # the page redrew what was found: look again
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_person_watches_the_quickstart_saves_it_and_stops_it(browser, tmp_path):
    from selenium.webdriver.common.by import By

    output = tmp_path / "runs"
    output.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # the quickstart, long enough to be watched: it ends only when the page stops it; the page is `wantrain serve`
    # of its output folder (--serve starts the same server in a child process that ends with the run)
    trainer = prewarmed.Popen(
        ["-m", "wantrain", "run", str(ROOT / "examples" / "quickstart.toml"),
         "--set", f'run.output_dir="{output}"', "--set", "train.max_steps=100000", "--set", "train.log_every=2",
         "--set", "train.save_every=100000", "--set", "validation.every=100000", "--set", "sample.every=100000"],
        env=env, stdout=(tmp_path / "out.txt").open("w"), stderr=(tmp_path / "err.txt").open("w"))  # never full
    server = PageServer(output, port=0).start()
    try:
        # generous: on a busy shared machine the quickstart takes minutes to start
        run_dir = wait_for(lambda: next(iter(output.iterdir()), None), 600, "the run directory", trainer)
        browser.get(server.token_url)  # the printed URL: the token goes into a cookie
        def open_run():
            rows = browser.find_elements(By.CSS_SELECTOR, f'tr[data-run="{run_dir.name}"] a')
            if rows:
                rows[0].click()
            return bool(rows)

        wait_for(open_run, what="the run in the list")

        def points():
            boxes = browser.find_elements(By.CSS_SELECTOR, "#chart-loss[data-points]")
            return int(boxes[0].get_attribute("data-points")) if boxes else 0

        first = wait_for(lambda: points() >= 2 and points(), 600, "the loss chart", trainer)
        wait_for(lambda: points() > first + 2, what="the loss chart to grow while the run trains", process=trainer)
        assert browser.find_element(By.ID, "run-status").text == "running"

        browser.find_element(By.CSS_SELECTOR, 'button[data-action="save"]').click()
        saved = wait_for(lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#checkpoints .file")
                                  if e.text.startswith("step_")], what="the checkpoint of 'save now'", process=trainer)
        checkpoint = run_dir / "checkpoints" / saved[0]
        assert (checkpoint / "complete.json").exists()
        screenshots = os.environ.get("WANTRAIN_SCREENSHOTS")
        if screenshots:
            wait_for(lambda: points() > 60, what="a longer chart for the screenshot")
            browser.save_screenshot(str(Path(screenshots) / "serve_run.png"))

        browser.find_element(By.CSS_SELECTOR, 'button[data-action="stop"]').click()
        browser.switch_to.alert.accept()  # "Stop the run? It saves ... (resumable)"
        wait_for(lambda: browser.find_element(By.ID, "run-status").text == "stopped", what="the run to stop")
        assert trainer.wait(timeout=120) == 3  # stopped, resumable
        err = (tmp_path / "err.txt").read_text()
        assert "continue with: " in err and "--resume auto" in err
        events = (run_dir / "events.jsonl").read_text()
        assert '"action":"save","source":"web"' in events and '"action":"stop","source":"web"' in events
        final = sorted((run_dir / "checkpoints").iterdir())[-1]
        assert (final / "complete.json").exists() and final.name != saved[0]
        assert all(b.get_attribute("disabled") for b in browser.find_elements(By.CSS_SELECTOR, ".controls button"))
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        server.stop()
        shutil.rmtree(output, ignore_errors=True)


def test_the_run_page_after_a_resume_shows_each_step_once_and_reads_well(browser, tmp_path):
    """A run's page open while it is resumed (the logs cut back by the resume's own ``cut_back``, then grown past
    their old size); the three display items: a prompt by its text, memory ticks told apart, one validation point
    in a narrow x range."""
    import json

    from selenium.webdriver.common.by import By

    from wantrain.core.events import RunStarted, to_record
    from wantrain.core.events.log import cut_back

    run = tmp_path / "runs" / "20260101_000000"
    (run / "samples").mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "demo"\n[sample]\nprompts = ["a red fox in the snow"]\n')
    started = to_record(RunStarted(step=0, run_dir=str(run), total_steps=200, grad_accum=1, experts=("high_noise",),
                                   log_every=1), 1, time.time())
    (run / "events.jsonl").write_text(json.dumps(started) + "\n")
    (run / "samples" / "step_000050_00.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")

    def rows(steps, loss=1.0):
        return "".join(json.dumps({"step": s, "train/loss": loss, "memory/ram_total_gb": 0.5611 + s * 1e-6,
                                   **({"val/loss": 0.3} if s == 50 else {})}) + "\n" for s in steps)

    (run / "metrics.jsonl").write_text(rows(range(1, 101)))
    server = PageServer(tmp_path / "runs", port=0).start()
    try:
        browser.get(server.token_url)
        browser.get(f"{server.url}#/run/{run.name}")

        def steps():
            return browser.execute_script("const c = state.charts.loss; return c ? c.plot.data[0] : []")

        wait_for(lambda: len(steps()) == 100, 60, "the loss chart")
        cut_back(run / "metrics.jsonl", 50)  # the resume from step 50 ...
        with (run / "metrics.jsonl").open("a") as fh:
            fh.write(rows(range(51, 151), loss=0.25))  # ... and the resumed run past the old size before a look
        wait_for(lambda: len(steps()) >= 150, 60, "the resumed run's steps")
        time.sleep(1.5)  # a few more polls: nothing is appended twice
        assert steps() == list(range(1, 151))
        losses = browser.execute_script("return state.charts.loss.plot.data[1]")
        assert losses == [1.0] * 50 + [0.25] * 100  # the resumed run's values, none of the old ones
        assert browser.find_element(By.ID, "run-status").text == "running"

        ticks = browser.execute_script("return state.charts.memory.plot.axes[1]._values")
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), ticks  # was "0.561 0.561 0.561"
        val = browser.execute_script("const x = state.charts.val.plot.scales.x; return [x.min, x.max]")
        assert val[0] < 50 < val[1] and val[1] - val[0] <= 10, val  # was 0..100 for one point
        browser.find_element(By.CSS_SELECTOR, 'a[data-tab="samples"]').click()
        prompt = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#samples td.prompt"), 30, "the samples")
        assert prompt[0].text == "a red fox in the snow"
    finally:
        server.stop()


def test_a_person_reviews_a_prepared_folders_captions_and_edits_one(browser, tmp_path):
    """The data view of a run (its Data tab) and of a folder given with --data: each clip with its strip of frames
    and its caption; an edited caption saved from the page lands in the caption file."""
    from selenium.webdriver.common.by import By

    from wantrain.data.demo import render, write_video

    clips = tmp_path / "clips"
    clips.mkdir()
    for k, colour in enumerate([(230, 40, 40), (40, 200, 70)]):
        write_video(clips / f"clip_{k}.mp4", render("circle", colour, (0, 0, 0), "left", 64, 48, 9), 16.0)
    (clips / "clip_0.txt").write_text("ohwx, a red circle\n")
    run = tmp_path / "runs" / "20260101_000000"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(f'[run]\nname = "demo"\n\n[data]\npath = "{clips}"\n')
    server = PageServer(tmp_path / "runs", port=0, data=(clips,)).start()
    try:
        browser.get(server.token_url)
        folder = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#folder-list a"), 30, "the --data folder")
        folder[0].click()
        boxes = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#folder-clips .clip"), 30, "the clips")
        assert [b.get_attribute("data-clip") for b in boxes] == ["clip_0.mp4", "clip_1.mp4"]
        assert boxes[0].find_element(By.CSS_SELECTOR, "textarea").get_attribute("value") == "ohwx, a red circle"
        wait_for(lambda: all(browser.execute_script("return arguments[0].naturalHeight", img) == 72
                             for img in browser.find_elements(By.CSS_SELECTOR, "#folder-clips img.strip")),
                 30, "the strips of frames")
        text = boxes[1].find_element(By.CSS_SELECTOR, "textarea")
        text.send_keys("ohwx, a green circle moving left")
        boxes[1].find_element(By.CSS_SELECTOR, "button.save-caption").click()
        wait_for(lambda: boxes[1].find_element(By.CSS_SELECTOR, ".saved").text == "saved", 30, "the caption saved")
        assert (clips / "clip_1.txt").read_text() == "ohwx, a green circle moving left\n"

        browser.get(f"{server.url}#/run/{run.name}")  # the run's own Data tab shows the same folder, edit included
        wait_for(lambda: browser.find_element(By.ID, "run-title").text == run.name, 30, "the run page")
        browser.find_element(By.CSS_SELECTOR, 'a[data-tab="data"]').click()
        boxes = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#run-clips .clip"), 30, "the run's clips")
        assert boxes[1].find_element(By.CSS_SELECTOR, "textarea").get_attribute("value") == \
            "ohwx, a green circle moving left"
    finally:
        server.stop()
