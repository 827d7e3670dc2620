"""Headless Chromium for the dashboard tests (Debian's ``chromium`` and ``chromium-driver``).

Installed on first use where missing (as root, or with sudo); the tests skip, saying why, only
where that install is impossible.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

PACKAGES = ("chromium", "chromium-driver")


def _binaries() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def ensure_chromium() -> tuple[str, str]:
    """Paths of chromium and chromedriver, installing the Debian packages if needed."""
    browser, driver = _binaries()
    if browser and driver:
        return browser, driver
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        pytest.skip("chromium is not installed and neither root nor sudo can install it "
                    "(apt-get install -y chromium chromium-driver)")
    if not shutil.which("apt-get"):
        pytest.skip("chromium is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in ([*sudo, "apt-get", "update", "-qq"],
                 [*sudo, "apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"cannot install {' '.join(PACKAGES)}: {' '.join(argv)} failed: "
                        f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    browser, driver = _binaries()
    if not (browser and driver):
        pytest.skip("apt-get installed chromium but chromium/chromedriver are not on PATH")
    return browser, driver



def console_errors(driver: object) -> list[dict]:
    """Browser console entries at error level since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
