"""Headless Chromium for the browser tests (selenium + the Debian chromium-driver).

Needs the Debian packages ``chromium`` and ``chromium-driver`` (``scripts/test`` installs them
when it runs as root); without them a test fails, saying how to install them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
)


@pytest.fixture
def make_browser() -> Iterator[Callable[..., Any]]:
    """Start a browser with ``FLAGS`` plus the given ones (each its own fresh profile); every
    browser is closed after the test."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(
            "headless Chromium is not installed: install the Debian packages chromium and "
            "chromium-driver (`apt-get update && apt-get install -y chromium chromium-driver`, "
            "which scripts/test runs when it is root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    started: list[tuple[Any, str]] = []

    def start(*extra: str) -> Any:
        profile = tempfile.mkdtemp(prefix="kvmeta-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, *extra):
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        try:
            driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        except BaseException:
            shutil.rmtree(profile, ignore_errors=True)
            raise
        driver.set_page_load_timeout(60)
        started.append((driver, profile))
        return driver

    yield start
    for driver, profile in started:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(make_browser: Callable[..., Any]) -> Any:
    """One browser with the default flags."""
    return make_browser()
