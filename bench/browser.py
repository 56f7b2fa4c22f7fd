"""Debian's headless chromium driven by Selenium through chromedriver: the console's browser
tests and its page-load benchmark both drive it. Both programs come from the system
(`.ci/system-packages` installs chromium and chromium-driver); nothing is downloaded at run
time, and the flags keep chromium off every network but the loopback."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["CHROMEDRIVER", "CHROMIUM", "CHROMIUM_FLAGS", "MISSING", "chromium"]

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = (
    "chromium and chromium-driver are not installed (.ci/system-packages installs them)"
    if CHROMIUM is None or CHROMEDRIVER is None
    else ""
)
# Chromium as root needs --no-sandbox; without the background-networking ones it tries to
# reach the outside network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
]


def chromium(profile: Path, log: Path, page_load_timeout: float = 30.0) -> Any:
    """A new headless chromium with a fresh profile in `profile` (an empty directory), its
    console messages kept (`driver.get_log("browser")`), chromedriver's log in `log`. The
    caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if MISSING:
        raise RuntimeError(MISSING)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        options=options, service=Service(executable_path=CHROMEDRIVER, log_output=str(log))
    )
    driver.set_page_load_timeout(page_load_timeout)
    return driver
