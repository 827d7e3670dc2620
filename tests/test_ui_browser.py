"""The run page in a real headless Chromium, against live runs (real Redis, Celery, moto S3).

Screenshots go to the test's tmp directory (``screenshots/``; the path is printed): the page of
a running run, of the same run done, the runs page, and a run paused by its quality gates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import console_errors, ensure_chromium
from tests.conftest import Pipeline, RedisServer, wait_until
from tests.test_quality_e2e import degenerate_engine
from tests.ui_support import Dashboard, running_ui, simulated_worker, write_prompts

pytestmark = pytest.mark.e2e

REFRESH_S = 1.0
ONE_REFRESH_S = REFRESH_S + 4.0  # the poll, plus the page's five API calls on 2 busy cores


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    """Selenium on headless Chromium, recording the browser console."""
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is missing: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1440,1400", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: object, tmp_path: Path, name: str) -> Path:
    path = tmp_path / "screenshots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    return path


def _text(driver: object, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def _open(driver: object, ui: Dashboard, run: str) -> None:
    driver.get(f"{ui.url}/runs/{run}?refresh={REFRESH_S}")
    wait_until(lambda: _text(driver, "samples-done") not in ("", "?"), 30,
               "the page's first refresh")


def test_run_page_follows_a_live_run(pipeline: Pipeline, model_cache: Path, tmp_path: Path,
                                     browser: object) -> None:
    with simulated_worker(pipeline, model_cache, "--time-scale", "3.0"), \
            running_ui(pipeline.env, tmp_path / "ui.log") as ui:
        pipeline.cli("enqueue", "--input", write_prompts(tmp_path / "in.jsonl", 32), "--run",
                     "live", "--shard-size", "8", check=True)
        _open(browser, ui, "live")
        shown: list[int] = []

        def moved() -> bool:
            shown.append(int(_text(browser, "samples-done")))
            return len({n for n in shown if 0 < n < 32}) >= 2
        wait_until(moved, 120, "the page's sample count to change twice while the run goes",
                   interval=0.3)
        assert shown == sorted(shown)
        assert _text(browser, "state") == "running"
        _shot(browser, tmp_path, "running")
        # The page catches up with `status --json` within one refresh.
        cli = pipeline.status("live")["samples"]["done"]
        wait_until(lambda: int(_text(browser, "samples-done")) >= cli, ONE_REFRESH_S,
                   f"the page to show at least the {cli} samples status printed")

        pipeline.wait_done("live")
        final = pipeline.status("live")
        wait_until(lambda: _text(browser, "state") == "done", ONE_REFRESH_S, "the page: done")
        assert int(_text(browser, "samples-done")) == final["samples"]["done"] == 32
        assert _text(browser, "samples-total") == "32"
        assert _text(browser, "shard-counts").startswith("4/4 committed")
        assert not browser.find_element("id", "paused").is_displayed()
        cells = browser.find_elements("css selector", "#shard-grid .cell.committed")
        assert len(cells) == 4
        assert browser.find_elements("css selector", "#chart-throughput canvas")
        _shot(browser, tmp_path, "done")
        assert console_errors(browser) == []

        browser.get(f"{ui.url}/?refresh={REFRESH_S}")
        row = '#runs tr[data-run="live"] td.samples'
        wait_until(lambda: [e.text for e in browser.find_elements("css selector", row)]
                   == ["32 / 32"], ONE_REFRESH_S, "the runs page to list the run, done")
        assert "done" in browser.find_element("css selector", '#runs tr[data-run="live"]').text
        _shot(browser, tmp_path, "runs")
        assert console_errors(browser) == []


def _bars(driver: object) -> dict[str, int]:
    """The histogram as drawn: label -> count, re-read from the page each call."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return {b.text.split()[0]: int(b.text.split()[-1]) for b in
                driver.find_elements("css selector", "#histogram .hbar")}
    except StaleElementReferenceException:  # redrawn under us: read again
        return {}


def _example_ids(driver: object) -> list[str]:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return [e.text for e in driver.find_elements("css selector", "#examples li b")]
    except StaleElementReferenceException:
        return []


def test_paused_run_shows_the_banner_with_the_resume_command(
        pipeline: Pipeline, redis_server: RedisServer, model_cache: Path, tmp_path: Path,
        browser: object) -> None:
    with degenerate_engine(pipeline, model_cache, 0.87), \
            running_ui(pipeline.env, tmp_path / "ui.log") as ui:
        pipeline.cli("enqueue", "--input", write_prompts(tmp_path / "in.jsonl", 160), "--run",
                     "seed", "--shard-size", "20", check=True)
        wait_until(lambda: pipeline.state("seed") == "paused", 120, "the run to pause")
        _open(browser, ui, "seed")
        wait_until(lambda: browser.find_element("id", "paused").is_displayed(), ONE_REFRESH_S,
                   "the paused banner")
        status = pipeline.status("seed")
        assert _text(browser, "resume-cmd") == "dflash-pipeline resume --run seed --accept-gates"
        assert status["pause"]["reason"] in _text(browser, "paused")
        wait_until(lambda: int(_text(browser, "samples-done")) == status["samples"]["done"],
                   ONE_REFRESH_S, "the page to show the paused run's sample count")
        assert _text(browser, "state") == "paused"
        assert "too_few_tokens" in _text(browser, "reasons")
        six = [b for b in browser.find_elements("css selector", "#histogram .hbar")
               if b.text.split()[0] == "6"]
        assert six and "below" in six[0].find_element("css selector", ".fill").get_attribute(
            "class")
        assert len(browser.find_elements("css selector", "#examples li")) >= 3
        assert _text(browser, "histogram-source").startswith("live")
        _shot(browser, tmp_path, "paused")
        assert console_errors(browser) == [], json.dumps(console_errors(browser))

        # After the run, Redis gone: the gate panels come from storage, the same figures.
        pipeline.stop_all()
        live = ui.json("/api/runs/seed/gates")
        assert live["source"] == "live" and live["window"]["rejected"] > 0
        wait_until(lambda: sum(_bars(browser).values()) == sum(
            b["count"] for b in live["supervised_tokens"]["histogram"]), ONE_REFRESH_S,
            "the page to draw the whole live histogram")
        drawn_live = _bars(browser)
        redis_server.kill()
        stored = ui.json("/api/runs/seed/gates")
        assert stored["source"] == "storage" and stored["redis"] is False
        assert stored["supervised_tokens"] == live["supervised_tokens"]
        assert stored["window"] == live["window"]
        assert {r: len(e) for r, e in stored["examples"].items()} == \
            {r: len(e) for r, e in live["examples"].items()}
        wait_until(lambda: _text(browser, "histogram-source").startswith("from storage"),
                   ONE_REFRESH_S, "the histogram to say it comes from storage")
        assert "Redis unreachable" in _text(browser, "examples-source")
        wait_until(lambda: _bars(browser) == drawn_live, ONE_REFRESH_S,
                   "the same histogram drawn from storage")
        shown = {x["id"] for listed in stored["examples"].values() for x in listed}
        wait_until(lambda: set(_example_ids(browser)) == shown and shown, ONE_REFRESH_S,
                   "the stored examples on the page")
        assert "rolling window" in _text(browser, "gate-window")
        _shot(browser, tmp_path, "redis-gone")
        assert console_errors(browser) == [], json.dumps(console_errors(browser))
