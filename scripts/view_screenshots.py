"""The screenshots of docs/view.md: `mha view` on all-MiniLM-L6-v2, opened in headless Chromium.

    python scripts/view_screenshots.py          # writes docs/images/view-grid.png and view-head.png

Needs the test extra (selenium, the hf extra) and Debian's chromium + chromium-driver.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from mha.cli import main

TEXT = "The cat sat on the mat because it was warm"
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def browser(width: int, height: int) -> webdriver.Chrome:
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                     f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def ready(driver) -> None:
    for _ in range(300):
        if driver.execute_script("return !!(window.mhaView && mhaView.ready)"):
            return
        time.sleep(0.05)
    raise RuntimeError(driver.execute_script("return window.mhaView && mhaView.error"))


def shoot() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "view.html"
        assert main(["view", "--text", TEXT, "-o", str(page)]) == 0
        driver = browser(1200, 760)
        try:
            driver.get(page.as_uri())
            ready(driver)
            driver.save_screenshot(str(IMAGES / "view-grid.png"))
            driver.set_window_size(1200, 1250)
            driver.execute_script("mhaView.open(2, 4); mhaView.select(5);")
            driver.save_screenshot(str(IMAGES / "view-head.png"))
        finally:
            driver.quit()
    print(f"wrote {IMAGES / 'view-grid.png'} and {IMAGES / 'view-head.png'}")


if __name__ == "__main__":
    shoot()
