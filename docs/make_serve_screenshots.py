"""The screenshots of docs/serve.md other than the live run (tests/serve/test_browser.py keeps that one with
``WANTRAIN_SCREENSHOTS=docs/img``): a finished quickstart run's samples and events, and an LR finder run.

    wantrain run examples/quickstart.toml && wantrain run examples/quickstart.toml --lr-finder --lr-finder-steps 40
    python docs/make_serve_screenshots.py runs          # needs Debian's chromium and chromium-driver, and selenium
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from wantrain.app.serve import PageServer

OUT = Path(__file__).resolve().parent / "img"


def main(root: Path) -> None:
    runs = sorted(p.name for p in root.iterdir() if (p / "events.jsonl").exists())
    finder = [r for r in runs if (root / r / "lr_finder.json").exists()]
    training = [r for r in runs if r not in finder and any((root / r / "samples").glob("*.mp4"))]
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    server = PageServer(root, port=0).start()
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    try:
        driver.get(server.token_url)  # the printed URL: the token goes into the cookie
        time.sleep(1.5)
        driver.save_screenshot(str(OUT / "serve_runs.png"))
        if training:
            driver.get(f"{server.url}#/run/{training[-1]}")
            time.sleep(2)
            driver.find_element(By.CSS_SELECTOR, 'a[data-tab="samples"]').click()
            time.sleep(2)
            driver.save_screenshot(str(OUT / "serve_samples.png"))
            driver.find_element(By.CSS_SELECTOR, 'a[data-tab="events"]').click()
            time.sleep(1)
            driver.save_screenshot(str(OUT / "serve_events.png"))
        if finder:
            driver.get(f"{server.url}#/run/{finder[-1]}")
            time.sleep(2.5)
            driver.save_screenshot(str(OUT / "serve_lr_finder.png"))
    finally:
        driver.quit()
        server.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs"))
