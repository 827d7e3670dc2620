"""Nothing silently stops: killed workers heal without `resume`, unexpected errors park.

Real Redis, real Celery worker processes, moto's S3 server and the CPU model; the visibility
timeout stays at its default (6 h), so only the reconciler can bring a killed worker's shard
back.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from common import keys
from common.queue.celery_app import GENERATE, HIDDEN, TRAIN
from common.runs.checkpoints import read_ledger
from common.runs.records import decode_jsonl_zst
from common.storage import open_storage
from tests.conftest import Pipeline, wait_until
from tests.test_generate_e2e import (
    _committed_samples,
    _mt_bench_rows,
    _write_jsonl,
    pipeline_requests,
    sent_requests,
)
from tests.test_hidden_e2e import generated_run, hidden_commits
from tests.test_train_e2e import TRAIN_ENV

pytestmark = pytest.mark.e2e

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def read_status(pipeline: Pipeline, run: str) -> dict:
    """The status read in-process by the same code as ``status --json`` (cheap to poll)."""
    from producer.status import StatusReader

    return StatusReader(open_storage(pipeline.env["DFLASH_STORAGE"]), redis_client(pipeline),
                        run).read()


def redis_client(pipeline: Pipeline):  # noqa: ANN201
    import redis

    return redis.Redis.from_url(pipeline.env["DFLASH_BROKER_URL"], decode_responses=True)


def owner_of(client, stage, run: str, shard: int) -> str | None:  # noqa: ANN001
    return client.hget(stage.keys(run).running, keys.shard_name(shard))


def stored_ids(storage, run: str) -> set[str]:  # noqa: ANN001
    parts = [*storage.list(keys.generated_prefix(run)), *storage.list(keys.rejected_prefix(run))]
    return {s["id"] for k in parts if keys.part_number(k) is not None
            for s in decode_jsonl_zst(storage.get(k))}


def test_killed_generate_worker_heals_without_resume(pipeline: Pipeline, tmp_path: Path) -> None:
    rows = _mt_bench_rows(24)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    client = redis_client(pipeline)
    pipeline.cli("enqueue", "--input", src, "--run", "heal", "--shard-size", "12",
                 "--max-new-tokens", "96", check=True)
    victim = pipeline.start_worker("victim", "--concurrency", "2")
    wait_until(lambda: storage.exists(keys.generated_part("heal", 0, 0)), 300, "a first part")
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.wait(timeout=60)
    assert not storage.exists(keys.generated_commit("heal", 0)), "shard 0 finished before the kill"
    kept = stored_ids(storage, "heal")
    # Work left, no live worker, nothing queued: status says so instead of "running".
    ttl = float(pipeline.env["DFLASH_LEASE_TTL"])
    wait_until(lambda: pipeline.state("heal") == "stalled", 3 * ttl + 30,
               "status to call the run stalled")

    pipeline.start_worker("rescuer", "--concurrency", "2")  # no resume from here on
    wait_until(lambda: (owner_of(client, GENERATE, "heal", 0) or "").startswith("rescuer@"),
               120, "the rescuer to take the killed worker's shard over")
    took_over = time.monotonic() - killed
    pipeline.wait_done("heal")
    print(f"\nkill -9 -> shard taken over by a new worker: {took_over:.1f}s "
          f"(lease TTL {pipeline.env['DFLASH_LEASE_TTL']}s, worker start included)")

    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "heal")
    ids = [s["id"] for s in samples]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in rows)
    assert len(ids) == len(set(ids))
    # What the records say was sent: a conversation stops at its first rejected turn.
    expected = sum(sent_requests(s) for s in samples if s["id"] not in kept)
    assert pipeline_requests(pipeline, "heal", "rescuer@") == expected, "kept parts regenerated"
    assert "queued again" in healer_logs(pipeline)


def test_killed_hidden_worker_heals_without_resume(pipeline: Pipeline, tmp_path: Path) -> None:
    storage = generated_run(pipeline, tmp_path, "hh")
    client = redis_client(pipeline)
    victim = pipeline.start_worker("victim", kind="hidden", DFLASH_HIDDEN_PART_BYTES="1",
                                   DFLASH_HIDDEN_BATCH_TOKENS="1")
    wait_until(lambda: client.hlen(HIDDEN.keys("hh").running), 60, "a hidden shard to start")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.wait()
    assert len(hidden_commits(storage, "hh")) < 2, "both shards finished before the kill"

    pipeline.start_worker("rescuer", kind="hidden", DFLASH_HIDDEN_PART_BYTES="1")
    wait_until(lambda: len(hidden_commits(storage, "hh")) == 2, 180, "both shards committed")
    print(f"\nhidden kill -9 -> both shards committed by the new worker: "
          f"{time.monotonic() - killed:.1f}s")
    from common.hidden.store import iter_hidden_records

    records = [(r["sample_id"], r["turn"]) for r in iter_hidden_records(storage, "hh")]
    accepted = [s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "hh")
                if s["quality"]["passed"]]
    assert len(records) == len(set(records)) == sum(len(s["turns"]) for s in accepted)
    assert "queued again" in healer_logs(pipeline)


def healer_logs(pipeline: Pipeline) -> str:
    """Any live worker's reconciler heals, whatever its stage: the line may be in any log."""
    return "".join(log.read_text() for log in pipeline.log_dir.glob("*.log"))


def parked(pipeline: Pipeline, run: str, stage: str) -> list[dict]:
    return [p for p in pipeline.status(run)["parked"] or [] if p["stage"] == stage]


def test_unexpected_hidden_error_parks_then_resume_finishes(pipeline: Pipeline,
                                                            tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "oom", "--shard-size", "2",
                 "--max-new-tokens", "96", check=True)
    pipeline.wait_done("oom")
    sick = pipeline.start_worker("sick", kind="hidden",
                                 DFLASH_TEST_FAULT=f"hidden.forward={OOM}")
    wait_until(lambda: len(parked(pipeline, "oom", "hidden")) == 2, 120, "both shards parked")
    status = pipeline.status("oom")
    assert all(OOM in p["reason"] for p in status["parked"])
    assert status["downstream"]["parked"] == 2 and status["downstream"]["committed"] == 0
    assert "Traceback" in (pipeline.log_dir / "sick.log").read_text()
    sick.send_signal(signal.SIGTERM)
    sick.wait(timeout=60)

    pipeline.start_worker("healthy", kind="hidden")
    report = json.loads(pipeline.cli("resume", "--run", "oom", "--json", check=True).stdout)
    assert report["downstream"] == 2
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    wait_until(lambda: len(hidden_commits(storage, "oom")) == 2, 120, "both shards committed")
    assert pipeline.status("oom")["downstream"]["parked"] == 0


def test_unexpected_train_error_parks_and_the_train_task_has_a_delivery_cap(
        pipeline: Pipeline, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    client = redis_client(pipeline)
    pipeline.start_worker("gen")
    # No held-out split: every shard must reach the (faulty) training forward.
    pipeline.cli("enqueue", "--input", src, "--run", "toom", "--shard-size", "2", "--mode",
                 "online", "--epochs", "1",
                 "--max-new-tokens", "128", "--heldout-min", "0", "--heldout-fraction",
                 "0", check=True)
    pipeline.wait_done("toom")
    # The delivery cap: a shard started more often than allowed is parked, never retried forever.
    client.hset(TRAIN.keys("toom").attempts, keys.shard_name(0), 5)
    sick = pipeline.start_worker("sick", kind="train", **TRAIN_ENV,
                                 DFLASH_TEST_FAULT=f"train.forward={OOM}")
    wait_until(lambda: len(parked(pipeline, "toom", "train")) == 2, 180, "both shards parked")
    reasons = {p["shard"]: p["reason"] for p in parked(pipeline, "toom", "train")}
    assert "without committing" in reasons[0] and OOM in reasons[1]
    assert pipeline.status("toom")["downstream"]["parked"] == 2
    sick.send_signal(signal.SIGTERM)
    sick.wait(timeout=60)

    pipeline.start_worker("healthy", kind="train", **TRAIN_ENV)
    report = json.loads(pipeline.cli("resume", "--run", "toom", "--json", check=True).stdout)
    assert report["downstream"] == 2
    wait_until(lambda: sorted(read_ledger(storage, "toom").done) == [0, 1], 240,
               "both shards trained")
    assert pipeline.status("toom")["downstream"]["parked"] == 0


def test_redis_wipe_mid_run_does_not_pause_a_healthy_run(pipeline: Pipeline, tmp_path: Path,
                                                         model_cache: Path) -> None:
    """Rejections spread through the run (10%) must not crowd the rebuilt rolling window."""
    from common.monitor.run_monitor import gate_events
    from tests.test_quality_e2e import degenerate_engine

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me fact number {i}."})
                           + "\n" for i in range(1200)))
    client = redis_client(pipeline)
    with degenerate_engine(pipeline, model_cache, 0.1, time_scale=0.1):
        pipeline.cli("enqueue", "--input", str(src), "--run", "wipe", "--shard-size", "20",
                     check=True)
        def many_rejections() -> dict | None:
            status = read_status(pipeline, "wipe")
            return status if status["gates"]["rejected"] > 45 else None

        before = wait_until(many_rejections, 300, "more than 45 rejections stored")
        assert before["state"] == "running" and before["gates"]["rate"] < 0.2
        client.flushall()
        wiped = read_status(pipeline, "wipe")
        # Nothing goes backwards: the counts Redis lost come from the stored parts.
        assert wiped["samples"]["done"] + wiped["samples"]["in_progress"] >= \
            before["samples"]["done"]
        assert wiped["gates"]["rejected"] >= before["gates"]["rejected"] - 2 * 20
        pipeline.cli("resume", "--run", "wipe", check=True)
        pipeline.wait_done("wipe", timeout=600)
    final = pipeline.status("wipe")
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    assert final["state"] == "done" and final["samples"]["done"] == 1200
    assert [kind for kind, _ in gate_events(storage, "wipe")] == [], "the run was paused"
    assert final["gates"]["rejected"] > 45 and final["gates"]["rate"] < 0.2
