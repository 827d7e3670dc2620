"""A generate worker owns its engine server: start, health, restart after kill -9, clean stop,
and death with the worker however it dies.

The engine is the SGLang-protocol simulator, launched by the worker through ``--engine-cmd``
exactly as it would launch ``python -m sglang.launch_server`` (under the same supervisor);
tests/test_sglang_real.py does the same with the real SGLang.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import psutil
import pytest

from common import keys
from common.storage import open_storage
from tests.conftest import Pipeline, free_port, wait_until
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl
from workers.generate.engines.supervisor import SUPERVISOR_MODULE

pytestmark = pytest.mark.e2e

SIM_CMD = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           "--model-path {model} --time-scale 2")


def _engines(port: int) -> list[psutil.Process]:
    """Simulator processes serving ``port`` (matched on their command line; not supervisors)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "embedded.simulator" in cmdline and str(port) in cmdline and _alive(proc) \
                and SUPERVISOR_MODULE not in cmdline:
            found.append(proc)
    return found


def _supervisors(port: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if SUPERVISOR_MODULE in (p.info["cmdline"] or []) and str(port) in
            (p.info["cmdline"] or []) and _alive(p)]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sglang_worker(pipeline: Pipeline, name: str, port: int, **env: str):  # noqa: ANN202
    return pipeline.start_worker(name, "--engine", "sglang", "--engine-cmd", SIM_CMD,
                                 "--max-in-flight", "16", DFLASH_ENGINE_PORT=str(port), **env)


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


def test_kill9_of_the_worker_takes_its_engine_down_and_the_shard_heals(
        pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(24))
    pipeline.cli("enqueue", "--input", src, "--run", "dies", "--shard-size", "12",
                 "--max-new-tokens", "256", check=True)
    port = free_port()
    victim = _sglang_worker(pipeline, "victim", port)
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    wait_until(lambda: storage.exists(keys.generated_part("dies", 0, 0)), 120, "a first part")
    engine = _engines(port)
    assert len(engine) == 1 and _listening(port)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not storage.exists(keys.generated_commit("dies", 1)), "the run ended before the kill"
    wait_until(lambda: not _alive(engine[0]) and not _engines(port) and not _supervisors(port)
               and not _listening(port), 30, "the engine to die with its worker")
    pipeline.start_worker("heir", "--engine", "sglang", "--engine-cmd", SIM_CMD,
                          DFLASH_ENGINE_PORT=str(free_port()))
    pipeline.wait_done("dies", timeout=300)
    ids = [s["id"] for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "dies")]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in _mt_bench_rows(24))


@pytest.mark.parametrize("supervisor_signal", [signal.SIGKILL, signal.SIGSTOP],
                         ids=["killed", "stopped"])
def test_an_engine_whose_supervisor_could_not_act_is_listed_by_doctor_and_stopped_by_the_next(
        pipeline: Pipeline, model_cache, tmp_path, supervisor_signal) -> None:  # noqa: ANN001
    from embedded.tinymodel import ensure_tiny_model

    # Pid files of its own (DFLASH_CACHE_DIR/engines): no other test's doctor sees this orphan.
    own = {"DFLASH_CACHE_DIR": str(tmp_path / "cache"),
           "DFLASH_MODEL": str(ensure_tiny_model(model_cache))}
    port = free_port()
    victim = _sglang_worker(pipeline, "victim", port, **own)
    orphan = _engines(port)
    assert len(orphan) == 1
    # The one way an engine outlives its worker: its supervisor cannot act (killed or stopped).
    for supervisor in _supervisors(port):
        supervisor.send_signal(supervisor_signal)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert _alive(orphan[0]), "the engine should outlive a kill -9 of its supervisor"

    pipeline.env.update(own)
    doctor = pipeline.cli("doctor", "--json")
    rows = [c for c in json.loads(doctor.stdout)["checks"]
            if c["name"].startswith("engine leftover")]
    assert len(rows) == 1 and rows[0]["status"] == "FAIL", rows
    assert str(orphan[0].pid) in rows[0]["detail"] and "engine-" in rows[0]["detail"]
    pgid = os.getpgid(orphan[0].pid)
    assert rows[0]["fix"] == f"stop it: kill -TERM -- -{pgid}; kill -CONT -- -{pgid}"

    _sglang_worker(pipeline, "successor", port, **own)
    wait_until(lambda: not _alive(orphan[0]), 30, "the stale engine to be stopped")
    engines = _engines(port)
    assert len(engines) == 1 and engines[0].pid != orphan[0].pid
    doctor = pipeline.cli("doctor", "--json")
    assert [c["status"] for c in json.loads(doctor.stdout)["checks"]
            if c["name"].startswith("engine leftover")] == ["PASS"]


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
