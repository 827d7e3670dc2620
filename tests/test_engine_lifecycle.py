"""A generate worker owns its engine server: start, health, restart after kill -9, clean stop.

The engine is the SGLang-protocol simulator, launched by the worker through ``--engine-cmd``
exactly as it would launch ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil
import pytest

from common import keys
from common.storage import open_storage
from tests.conftest import Pipeline, free_port, wait_until
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl

pytestmark = pytest.mark.e2e

SIM_CMD = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           "--model-path {model} --time-scale 2")


def _engines(port: int) -> list[psutil.Process]:
    """Simulator processes serving ``port`` (matched on their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "embedded.simulator" in cmdline and str(port) in cmdline and _alive(proc):
            found.append(proc)
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sglang_worker(pipeline: Pipeline, name: str, port: int):  # noqa: ANN202
    return pipeline.start_worker(name, "--engine", "sglang", "--engine-cmd", SIM_CMD,
                                 "--max-in-flight", "16", DFLASH_ENGINE_PORT=str(port))


def test_engine_killed_mid_shard_is_restarted_and_nothing_is_left(
        pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    rows = _mt_bench_rows(32)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    pipeline.cli("enqueue", "--input", src, "--run", "life", "--shard-size", "16",
                 "--max-new-tokens", "256", check=True)
    port = free_port()
    worker = _sglang_worker(pipeline, "owner", port)
    first = _engines(port)
    assert len(first) == 1, "the worker did not start exactly one engine"

    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    wait_until(lambda: storage.exists(keys.generated_part("life", 0, 0)), 120, "a first part")
    first[0].kill()
    assert not storage.exists(keys.generated_commit("life", 1)), "the run ended before the kill"
    wait_until(lambda: [p for p in _engines(port) if p.pid != first[0].pid], 60,
               "the worker to restart its engine")
    pipeline.wait_done("life", timeout=300)
    ids = [s["id"] for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "life")]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in rows)
    assert len(ids) == len(set(ids))
    sample = _committed_samples(pipeline.env["DFLASH_STORAGE"], "life")[0]
    assert sample["engine"]["engine"] == "sglang"
    assert all(t["output_ids"] for t in sample["turns"])

    engines = pipeline.status("life")["engines"]
    assert any(e["url"].endswith(f":{port}") and os.path.exists(e["log"])
               for e in engines.values()), engines
    log = (pipeline.log_dir / "owner.log").read_text()
    assert "restarting" in log and "retry" in log, "no request was in flight across the restart"

    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)
    wait_until(lambda: not _engines(port), 30, "the engine to be gone after the worker stopped")


def test_stale_engine_of_a_killed_worker_is_cleaned_up_by_the_next(
        pipeline: Pipeline) -> None:
    port = free_port()
    victim = _sglang_worker(pipeline, "victim", port)
    orphan = _engines(port)
    assert len(orphan) == 1
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert _alive(orphan[0]), "the engine should outlive a kill -9 of its worker"

    _sglang_worker(pipeline, "successor", port)
    wait_until(lambda: not _alive(orphan[0]), 30, "the stale engine to be stopped")
    engines = _engines(port)
    assert len(engines) == 1 and engines[0].pid != orphan[0].pid


def test_an_engine_refusing_every_request_parks_the_shard_with_its_words(
        pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    # A server launched with --api-key answers 401 to every request: a setting, not the data.
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(6))
    pipeline.cli("enqueue", "--input", src, "--run", "locked", "--shard-size", "6",
                 "--max-new-tokens", "64", check=True)
    pipeline.start_worker("locked", "--engine", "sglang", "--engine-cmd",
                          f"{SIM_CMD} --api-key sesame", DFLASH_ENGINE_PORT=str(free_port()))
    wait_until(lambda: pipeline.state("locked") == "failed", 120, "the shard to be parked")
    status = pipeline.status("locked")
    assert status["shards"]["parked"] == 1
    reason = status["parked"][0]["reason"]
    assert "refused all 6 requests" in reason and "HTTP 401: Unauthorized" in reason, reason
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    assert not list(storage.list(keys.rejected_prefix("locked"))), "samples stored as rejected"
    assert not list(storage.list(keys.generated_prefix("locked")))
    assert "sesame" not in (pipeline.log_dir / "locked.log").read_text()
