"""The dashboard as a real ``dflash-pipeline ui`` process, and a live run for it to show."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from producer.demo import free_port
from tests.conftest import MT_BENCH, ROOT, Pipeline, running_simulator, wait_until


@dataclass(frozen=True)
class Dashboard:
    url: str
    log: Path
    auth: str = ""

    def get(self, path: str, auth: str | None = None) -> tuple[int, bytes]:
        """(HTTP status, body) of a GET; ``auth`` defaults to the dashboard's own."""
        request = urllib.request.Request(self.url + path)
        given = self.auth if auth is None else auth
        if given:
            token = base64.b64encode(given.encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def json(self, path: str) -> dict:
        status, body = self.get(path)
        assert status == 200, (path, status, body[:500])
        return json.loads(body)


@contextmanager
def running_ui(env: dict[str, str], log: Path, *args: str, auth: str = "") -> Iterator[Dashboard]:
    """``dflash-pipeline ui`` on a free loopback port, once it answers HTTP."""
    port = free_port()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "ui", "--port", str(port), *args],
            env={**env, "DFLASH_UI_AUTH": auth}, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    board = Dashboard(f"http://127.0.0.1:{port}", log, auth)

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return board.get("/api/runs")[0] in (200, 401)
        except OSError:
            return False

    try:
        wait_until(up, 60, "the dashboard to answer")
        yield board
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def write_prompts(path: Path, n: int) -> str:
    """``n`` distinct two-turn prompts made from the MT-Bench questions."""
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    with path.open("w") as fh:
        for i in range(n):
            q = questions[i % len(questions)]
            fh.write(json.dumps({"question_id": f"q{i}", "turns": [
                f"{q['turns'][0]} (variant {i})", q["turns"][1]]}) + "\n")
    return str(path)


@contextmanager
def simulated_worker(pipeline: Pipeline, model_cache: Path, *sim_args: str) -> Iterator[str]:
    """A generate worker on the SGLang-protocol simulator (fast, yet a real engine server)."""
    from embedded.tinymodel import ensure_tiny_model

    tiny = ensure_tiny_model(model_cache)
    with running_simulator("--tokenizer", str(tiny), "--len-mu", "4.5", "--len-sigma", "0.3",
                           "--enable-metrics", *sim_args) as url:
        # One shard at a time (the SGLang default holds two): commits, and so the page's
        # counts, step through every shard.
        pipeline.start_worker("gen", "--engine", "sglang", "--engine-url", url,
                              "--concurrency", "1")
        yield url


# The page's refresh rebuilds its panels: an element found before it is stale after it. So a
# test never keeps a handle; every read re-finds its element, inside a wait that retries a read
# that a refresh cut short.
def wait_page(driver: object, condition: Callable[[object], object], timeout: float,
              what: str) -> object:
    """Poll ``condition(driver)`` until truthy (a stale or missing element counts as not yet)."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException))
    try:
        return wait.until(condition)
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}") from None


def page_texts(driver: object, *element_ids: str) -> list[str | None]:
    """The visible texts of several elements read in one script, so all from the same refresh
    (None for an element the page does not have)."""
    return driver.execute_script(
        "return arguments[0].map(id => { const e = document.getElementById(id);"
        " return e ? e.innerText.trim() : null; });", list(element_ids))
