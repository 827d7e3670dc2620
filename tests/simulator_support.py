"""A running SGLang simulator for the tests: start it on a free port, call it, stop it."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, call_json, free_port, wait_until


@dataclass
class Sim:
    """A running ``python -m embedded.simulator`` process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def call(self, path: str, body: Any = None) -> tuple[int, Any]:
        """GET (no body) or POST JSON; returns (status, parsed JSON or text)."""
        return call_json(self.url + path, body, timeout=30)

    def health(self) -> int | None:
        try:
            return self.call("/health")[0]
        except urllib.error.URLError:  # not listening yet
            return None

    def generate(self, input_ids: Any, **sampling: Any) -> dict:
        status, body = self.call("/generate", {"input_ids": input_ids,
                                               "sampling_params": sampling})
        assert status == 200, body
        return body

    def stop(self) -> None:
        """SIGTERM must end the server promptly and cleanly."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=15) == 0, self.log.read_text()[-3000:]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def launch(log_dir: Path, *args: str, healthy: bool = True) -> Sim:
    """Start a simulator on a free port and wait until it answers (with 200 when ``healthy``)."""
    port = free_port()
    log = log_dir / f"sim-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedded.simulator", "--port", str(port), *args],
            stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    sim = Sim(proc, f"http://127.0.0.1:{port}", log)
    wanted = (200,) if healthy else (200, 503)
    wait_until(lambda: sim.health() in wanted or proc.poll() is not None, 30, "the simulator")
    assert proc.poll() is None, log.read_text()[-3000:]
    return sim


@pytest.fixture(name="start")
def simulator_starter(tmp_path: Path) -> Iterator[Any]:
    """``start(*args)``: a simulator of this test, stopped (cleanly, or the test fails) after it."""
    sims: list[Sim] = []

    def _start(*args: str, healthy: bool = True) -> Sim:
        sims.append(launch(tmp_path, *args, healthy=healthy))
        return sims[-1]

    yield _start
    for sim in sims:
        sim.stop()
