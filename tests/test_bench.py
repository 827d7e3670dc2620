"""``dflash-pipeline bench`` against the engine simulator: table shape, requests held open."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, free_port, running_simulator


@pytest.fixture
def simulator() -> Iterator[str]:
    # Steps at full time: a request lasts long enough (~0.4 s) that concurrency 32 shows as 32
    # running at once in the simulator's counters, however busy the machine.
    with running_simulator("--max-running", "32", "--time-scale", "1") as url:
        yield url


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_bench_table_grows_with_concurrency_up_to_the_cap(simulator: str) -> None:
    result = _bench("--engine-url", simulator, "--concurrency", "2,8,32", "--num", "32",
                    "--max-new-tokens", "128", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["concurrency"] for r in rows] == [2, 8, 32]
    for row in rows:
        assert row["requests"] == 32 and row["output_tokens"] > 0
        assert row["latency_p99_s"] >= row["latency_p50_s"] > 0
    # Tok/s depend on the machine's load (the simulator's own figures:
    # benchmarks/simulator_throughput.py); what the bench controls is how many it keeps open.
    best = max(rows, key=lambda r: r["output_tokens_per_s"])
    assert report["best_concurrency"] == best["concurrency"]
    with urllib.request.urlopen(simulator + "/sim/stats", timeout=30) as resp:
        assert json.loads(resp.read())["max_running_seen"] == 32

    table = _bench("--engine-url", simulator, "--concurrency", "4", "--num", "8")
    assert table.returncode == 0, table.stderr
    assert "out tok/s" in table.stdout and "best: concurrency 4" in table.stdout


def test_bench_reports_bad_input_and_unreachable_engine() -> None:
    bad = _bench("--engine-url", "http://127.0.0.1:1", "--concurrency", "a,b")
    assert bad.returncode == 2 and "--concurrency" in bad.stderr
    down = _bench("--engine-url", f"http://127.0.0.1:{free_port()}", "--num", "1",
                  "--concurrency", "1")
    assert down.returncode == 1 and "cannot benchmark" in down.stderr
