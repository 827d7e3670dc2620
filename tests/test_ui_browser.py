"""The run page in a real headless Chromium, against live runs (real Redis, Celery, moto S3).

Screenshots go to the test's tmp directory (``screenshots/``; the path is printed): the page of
a running run, of the same run done, the runs page, and a run paused by its quality gates. The
running and the paused page are also the docs site's pictures of the dashboard
(``docs/img/dashboard.png``, ``docs/img/dashboard-paused.png``): each run of these tests takes
them again, from a real run, and a commit of the images keeps the docs current. The
page rebuilds its panels on every refresh, so each check re-finds its elements inside a wait
(:func:`tests.ui_support.wait_page`) and no element handle outlives one read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import console_errors, ensure_chromium
from tests.conftest import ROOT, Pipeline, RedisServer, wait_until
from tests.test_quality_e2e import degenerate_engine
from tests.ui_support import (
    Dashboard,
    page_texts,
    running_ui,
    simulated_worker,
    wait_page,
    write_prompts,
)

pytestmark = pytest.mark.e2e

REFRESH_S = 1.0
# A bound on waits for what the next refresh shows, not a timing check: generous enough for the
# page's five API calls on 2 cores under other load; a page that stopped refreshing still fails.
ONE_REFRESH_S = REFRESH_S + 30.0
# The live run's engine drafts (the simulator's NEXTN): the Engines panel shows its accept length.
DRAFTING = ("--speculative-algorithm", "NEXTN", "--accept-length", "2.5")


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


DOCS_IMG = ROOT / "docs" / "img"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _shot(driver: object, tmp_path: Path, name: str, docs: str | None = None) -> Path:
    """A screenshot under the test's tmp directory; with ``docs``, also the docs' picture."""
    path = tmp_path / "screenshots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    if docs is not None:
        assert path.read_bytes()[:8] == PNG_MAGIC
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        staged = DOCS_IMG / f".{docs}.tmp"   # replaced whole: a reader never sees half a file
        shutil.copyfile(path, staged)
        staged.replace(DOCS_IMG / docs)
    return path


def _text(driver: object, element_id: str) -> str:
    """One read, for a :func:`wait_page` condition (which retries it if a refresh cuts in)."""
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def _open(driver: object, ui: Dashboard, run: str) -> None:
    driver.get(f"{ui.url}/runs/{run}?refresh={REFRESH_S}")
    wait_page(driver, lambda d: _text(d, "samples-done") not in ("", "?"), 30,
              "the page's first refresh")


def _shows(driver: object, element_id: str, expected: str, what: str) -> None:
    wait_page(driver, lambda d: _text(d, element_id) == expected, ONE_REFRESH_S, what)


def test_run_page_follows_a_live_run(pipeline: Pipeline, model_cache: Path, tmp_path: Path,
                                     browser: object) -> None:
    with simulated_worker(pipeline, model_cache, "--time-scale", "3.0", *DRAFTING), \
            running_ui(pipeline.env, tmp_path / "ui.log") as ui:
        pipeline.cli("enqueue", "--input", write_prompts(tmp_path / "in.jsonl", 32), "--run",
                     "live", "--shard-size", "8", check=True)
        _open(browser, ui, "live")
        shown: list[tuple[int, str]] = []

        def moved(d: object) -> bool:
            done, state = page_texts(d, "samples-done", "state")
            shown.append((int(done), state))
            return len({n for n, _ in shown if 0 < n < 32}) >= 2
        wait_page(browser, moved, 120,
                  "the page's sample count to change twice while the run goes")
        assert [n for n, _ in shown] == sorted(n for n, _ in shown)
        assert {state for n, state in shown if 0 < n < 32} == {"running"}, shown
        _shot(browser, tmp_path, "running", docs="dashboard.png")
        # The page catches up with `status --json` within one refresh.
        cli = pipeline.status("live")["samples"]["done"]
        wait_page(browser, lambda d: int(_text(d, "samples-done")) >= cli, ONE_REFRESH_S,
                  f"the page to show at least the {cli} samples status printed")

        pipeline.wait_done("live")
        final = pipeline.status("live")
        assert final["samples"]["done"] == 32
        _shows(browser, "state", "done", "the page: done")
        _shows(browser, "samples-done", "32", "the page: 32 samples done")
        _shows(browser, "samples-total", "32", "the page: 32 samples in all")
        wait_page(browser, lambda d: _text(d, "shard-counts").startswith("4/4 committed"),
                  ONE_REFRESH_S, "the page: 4/4 shards committed")
        wait_page(browser, lambda d: not d.find_element("id", "paused").is_displayed(),
                  ONE_REFRESH_S, "no paused banner")
        wait_page(browser, lambda d: len(d.find_elements(
            "css selector", "#shard-grid .cell.committed")) == 4, ONE_REFRESH_S,
            "four committed cells in the shard grid")
        wait_page(browser, lambda d: d.find_elements("css selector", "#chart-throughput canvas"),
                  ONE_REFRESH_S, "the throughput chart")
        _shows_an_eval(browser, pipeline)
        _shot(browser, tmp_path, "done")
        assert console_errors(browser) == []
        _engines_fit(browser, tmp_path, pipeline)

        browser.get(f"{ui.url}/?refresh={REFRESH_S}")
        row = '#runs tr[data-run="live"]'
        wait_page(browser, lambda d: [e.text for e in d.find_elements(
            "css selector", f"{row} td.samples")] == ["32 / 32"], ONE_REFRESH_S,
            "the runs page to list the run, done")
        wait_page(browser, lambda d: "done" in d.find_element("css selector", row).text,
                  ONE_REFRESH_S, "the runs page: the run is done")
        _shot(browser, tmp_path, "runs")
        assert console_errors(browser) == []


def _shows_an_eval(driver: object, pipeline: Pipeline) -> None:
    """An eval-drafter --dataset table stored under the run: the eval panel shows its rows."""
    from common.runs.evals import write_eval
    from common.storage import open_storage
    from tests.test_report_eval import result

    write_eval(open_storage(pipeline.env["DFLASH_STORAGE"]), "live", {**result(), "run": "live"},
               4, None)
    wait_page(driver, lambda d: [e.text.split()[0] for e in d.find_elements(
        "css selector", "#eval-table tbody tr")] == ["gsm8k", "mt-bench"], ONE_REFRESH_S,
        "the eval panel's table: gsm8k and mt-bench")
    wait_page(driver, lambda d: "speedup 2x@1 1.2x@8" in _text(d, "eval-bars"), ONE_REFRESH_S,
              "the eval panel's bars with the speedups")
    assert not driver.find_element("id", "no-eval").is_displayed()


# Whether the Engines panel shows every column without a horizontal scroll bar: its content is
# no wider than the panel, and each cell ends inside it.
_ENGINES_FIT = """
const panel = document.querySelector("#engines").closest(".panel");
const right = panel.getBoundingClientRect().right;
const cells = [...document.querySelectorAll("#engines td")];
return {rows: document.querySelectorAll("#engines tr").length,
        scroll: panel.scrollWidth - panel.clientWidth,
        outside: cells.filter((c) => c.getBoundingClientRect().right > right + 0.5).length};
"""


# A second engine as a worker on a cloud host announces it (its name and URL as long as such
# hosts' are); the dashboard cannot reach it from here, so its row says why.
CLOUD_HOST = "ip-172-31-45-118.us-west-2.compute.internal"


def _engines_fit(driver: object, tmp_path: Path, pipeline: Pipeline) -> None:
    """At 1280 px wide, the Engines panel shows every column without horizontal scroll."""
    import redis

    from common.queue import redis_keys

    client = redis.Redis.from_url(pipeline.env["DFLASH_BROKER_URL"], decode_responses=True)
    client.hset(redis_keys.redis_engines(), f"{CLOUD_HOST}:gpu7", json.dumps(
        {"url": f"http://{CLOUD_HOST}:30007", "log": "/var/cache/dflash-pipeline/engines/"
         "engine-30007.log", "pid": 4242, "worker": f"generate-gpu7@{CLOUD_HOST}",
         "algorithm": "NEXTN"}))
    driver.set_window_size(1280, 1000)
    try:
        wait_page(driver, lambda d: d.execute_script(_ENGINES_FIT)["rows"] > 1, ONE_REFRESH_S,
                  "the Engines panel's rows at 1280 px")
        fit = driver.execute_script(_ENGINES_FIT)
        _shot(driver, tmp_path, "engines-1280")
        assert fit["scroll"] <= 0 and fit["outside"] == 0, fit
        # Each row's probe is its own engine's: the one here answers, the far one does not.
        health = {r[0]: r[2] for r in (row.split("\t") for row in driver.execute_script(
            "return [...document.querySelectorAll('#engines tr')].map("
            "(tr) => [...tr.cells].map((c) => c.innerText).join('\\t'))"))}
        assert health[f"{CLOUD_HOST}:gpu7"] == "unhealthy", health
        assert [v for k, v in health.items() if k != f"{CLOUD_HOST}:gpu7"] == ["healthy"]
    finally:
        driver.set_window_size(1440, 1400)


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
        wait_page(browser, lambda d: d.find_element("id", "paused").is_displayed(),
                  ONE_REFRESH_S, "the paused banner")
        status = pipeline.status("seed")
        _shows(browser, "resume-cmd", "dflash-pipeline resume --run seed --accept-gates",
               "the resume command")
        wait_page(browser, lambda d: status["pause"]["reason"] in _text(d, "paused"),
                  ONE_REFRESH_S, f"the banner to give the reason {status['pause']['reason']!r}")
        _shows(browser, "samples-done", str(status["samples"]["done"]),
               "the page to show the paused run's sample count")
        _shows(browser, "state", "paused", "the page: paused")
        wait_page(browser, lambda d: "too_few_tokens" in _text(d, "reasons"), ONE_REFRESH_S,
                  "the reasons panel to name too_few_tokens")

        def six_below(d: object) -> bool:
            bars = [b for b in d.find_elements("css selector", "#histogram .hbar")
                    if b.text.split()[:1] == ["6"]]
            return bool(bars) and "below" in bars[0].find_element(
                "css selector", ".fill").get_attribute("class")
        wait_page(browser, six_below, ONE_REFRESH_S, "the 6-token bar marked below the gate")
        wait_page(browser, lambda d: len(d.find_elements("css selector", "#examples li")) >= 3,
                  ONE_REFRESH_S, "three examples or more")
        wait_page(browser, lambda d: _text(d, "histogram-source").startswith("live"),
                  ONE_REFRESH_S, "the histogram to say it is live")
        _shot(browser, tmp_path, "paused", docs="dashboard-paused.png")
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
        wait_page(browser, lambda d: _text(d, "histogram-source").startswith("from storage"),
                  ONE_REFRESH_S, "the histogram to say it comes from storage")
        wait_page(browser, lambda d: "Redis unreachable" in _text(d, "examples-source"),
                  ONE_REFRESH_S, "the examples panel to say Redis is unreachable")
        wait_until(lambda: _bars(browser) == drawn_live, ONE_REFRESH_S,
                   "the same histogram drawn from storage")
        shown = {x["id"] for listed in stored["examples"].values() for x in listed}
        wait_until(lambda: set(_example_ids(browser)) == shown and shown, ONE_REFRESH_S,
                   "the stored examples on the page")
        wait_page(browser, lambda d: "rolling window" in _text(d, "gate-window"),
                  ONE_REFRESH_S, "the gate window to be the rolling window")
        _shot(browser, tmp_path, "redis-gone")
        assert console_errors(browser) == [], json.dumps(console_errors(browser))
