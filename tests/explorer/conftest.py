"""A real browser for the explorer's pages: headless Chromium (Debian's chromium and
chromium-driver; .ci/run installs them) driven by selenium. Where none can be started, the tests
that need one skip and say why. Screenshots go to test-artifacts/explorer/ (or $MHA_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("MHA_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")) / "explorer"


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or (name if os.path.exists(name) else None)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (the test extra brings it)")
    binary = _find("chromium", "chromium-browser", "/usr/bin/chromium")
    driver_path = _find("chromedriver", "/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no Chromium and chromedriver here (apt-get install chromium chromium-driver; .ci/run does it "
                    "where it may)")
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as error:  # noqa: BLE001  (any failure to start is a reason to skip, said)
        pytest.skip(f"Chromium would not start under selenium: {type(error).__name__}: {str(error)[:300]}")
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


class Page:
    """An explorer page opened in the browser, and what the tests ask of it."""

    def __init__(self, driver, path: Path) -> None:
        self.driver = driver
        started = time.perf_counter()
        driver.get(path.resolve().as_uri())
        deadline = started + 30
        while not driver.execute_script("return !!(window.mhaView && (mhaView.ready || mhaView.error))"):
            if time.perf_counter() > deadline:
                raise AssertionError("the page did not get ready in 30 s")
            time.sleep(0.02)
        self.seconds_to_ready = time.perf_counter() - started
        error = driver.execute_script("return mhaView.error")
        assert error is None, f"the page failed to load: {error}"

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def console_errors(self) -> list[str]:
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path


@pytest.fixture
def open_page(browser):
    browser.get_log("browser")  # drop what earlier pages logged

    def opener(path: Path) -> Page:
        return Page(browser, path)
    return opener
