"""Flower against the test broker: the generate worker is online and the run's tasks appear."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, Pipeline, free_port, wait_until
from tests.test_generate_e2e import (
    _committed_samples,
    _mt_bench_rows,
    _write_jsonl,
    sent_requests,
)

pytestmark = pytest.mark.e2e

AUTH = "watcher:s3cret-pw"


def _get(url: str, auth: str | None = AUTH) -> tuple[int, object]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            return response.status, json.loads(body) if body.startswith((b"{", b"[")) else body
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError):
        return 0, None


@pytest.fixture
def flower(pipeline: Pipeline) -> Iterator[str]:
    port = free_port()
    log = open(pipeline.log_dir / "flower.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "common.queue.celery_app", "flower",
         f"--port={port}", "--address=127.0.0.1", f"--basic-auth={AUTH}"],
        env=pipeline.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get(f"{url}/healthcheck")[0] == 200, 60, "Flower to answer")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def test_flower_sees_worker_and_tasks_and_worker_exports_metrics(
        pipeline: Pipeline, flower: str, tmp_path) -> None:  # noqa: ANN001
    assert _get(f"{flower}/api/workers", auth=None)[0] == 401
    metrics_port = free_port()
    pipeline.start_worker("flowerw", DFLASH_METRICS_PORT=str(metrics_port))
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    pipeline.cli("enqueue", "--input", src, "--run", "fl", "--shard-size", "2",
                 "--max-new-tokens", "32", check=True)
    pipeline.wait_done("fl")

    def worker_online() -> bool:
        status, workers = _get(f"{flower}/api/workers?refresh=1")
        return status == 200 and any(name.startswith("flowerw@") for name in workers or {})

    wait_until(worker_online, 60, "Flower to list the generate worker")

    def shard_tasks() -> list[dict]:
        status, tasks = _get(f"{flower}/api/tasks")
        if status != 200 or not isinstance(tasks, dict):
            return []
        return [t for t in tasks.values() if t.get("name") == "dflash.generate_shard"
                and '"fl"' in str(t.get("args", "")).replace("'", '"')]

    tasks = wait_until(lambda: len(shard_tasks()) >= 2 and shard_tasks(), 60,
                       "Flower to show the run's tasks")
    assert {t["state"] for t in tasks} == {"SUCCESS"}
    assert all(t["worker"].startswith("flowerw@") for t in tasks)

    # Our own progress, as Prometheus metrics from the worker.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'dflash_samples_generated_total{run="fl"} 4.0' in text
    assert 'dflash_shards_committed_total{run="fl"} 2.0' in text
    sent = sum(sent_requests(s) for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "fl"))
    assert 4 <= sent <= 8   # two turns each, unless a rejected first turn stopped one
    assert f'dflash_engine_requests_total{{run="fl"}} {sent:.1f}' in text
    assert "dflash_engine_in_flight 0.0" in text
    # No auth on that endpoint: it listens on loopback alone unless DFLASH_METRICS_HOST says so.
    import psutil

    listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == metrics_port}
    assert listening == {"127.0.0.1"}, listening
