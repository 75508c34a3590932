"""Headless Chromium for the dashboard test, from Debian's ``chromium`` and ``chromium-driver``.

When either binary is missing and this process may run apt-get (root on Debian), they are
installed here; where that cannot be done the test is skipped with the reason. CI on a fresh
machine therefore installs them on its first run (about a minute, once)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CHROMIUM = ("chromium", "chromedriver")


def _missing() -> list[str]:
    return [b for b in CHROMIUM if shutil.which(b) is None]


def ensure_chromium() -> tuple[str, str]:
    if _missing():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip(f"{', '.join(_missing())} not installed and apt-get is not usable here "
                        "(needs root on Debian): apt-get install -y chromium chromium-driver")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
            try:
                subprocess.run(cmd, env=env, check=True, timeout=900, capture_output=True)
            except (subprocess.SubprocessError, OSError) as exc:
                pytest.skip(f"could not install chromium and chromium-driver: {exc}")
        if _missing():
            pytest.skip(f"apt-get ran but {', '.join(_missing())} is still missing")
    chromium, driver = (shutil.which(b) for b in CHROMIUM)
    assert chromium is not None and driver is not None
    return chromium, driver


def chrome(width: int = 1400, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))
