"""The reconciler heals what Redis forgot, for real: Redis, Celery workers, moto S3, CPU model.

Each test does its fault (a worker killed between its commit and its hand-off, a deleted queue,
a message lost under its marker, an S3 403) and waits, with no ``resume`` and no human, for the
run to reach every downstream commit within three lease TTLs of the fault (two for a trainer).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from common import keys
from common.queue import redis_keys
from common.queue.celery_app import GENERATE, HIDDEN
from common.queue.dispatch import queued_in
from common.storage import open_storage
from tests.conftest import Pipeline, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.test_healing_e2e import parked, redis_client
from tests.test_hidden_e2e import hidden_commits

pytestmark = pytest.mark.e2e

TTL = 10.0  # long enough for a hidden worker to extract a small shard on a busy 2-core CPU


# Short generations of the tiny model fail the gates; downstream stages need accepted samples.
ANY_SAMPLE = [arg for gate in ("truncated", "thinking", "empty_answer", "leakage", "duplicates")
              for arg in ("--skip-gate", gate)]


def deadline(fault: float, ttls: float) -> float:
    """Seconds left until ``ttls`` lease TTLs after the fault (monotonic clock)."""
    return max(fault + ttls * TTL - time.monotonic(), 0.1)


def enqueue(pipeline: Pipeline, tmp_path: Path, run: str, rows: int, shard_size: int) -> None:
    src = _write_jsonl(tmp_path / f"{run}.jsonl", _mt_bench_rows(rows))
    pipeline.cli("enqueue", "--input", src, "--run", run, "--shard-size", str(shard_size),
                 "--max-new-tokens", "32", *ANY_SAMPLE, check=True)


def consuming(pipeline: Pipeline, worker: str, queue: str, on: bool) -> None:
    """Stop or restart a live worker's consumer of ``queue`` (Celery's remote control)."""
    import socket

    from common.config import load_settings
    from common.queue.celery_app import make_app

    app = make_app(load_settings(env=pipeline.env))
    node = f"{worker}@{socket.gethostname()}"
    do = app.control.add_consumer if on else app.control.cancel_consumer
    assert do(queue, destination=[node], reply=True, timeout=30), f"{node} did not answer"


@pytest.fixture
def slow_lease(pipeline: Pipeline) -> Pipeline:
    pipeline.env["DFLASH_LEASE_TTL"] = str(TTL)
    return pipeline


def test_a_generate_worker_killed_between_commit_and_hand_off(slow_lease: Pipeline,
                                                              tmp_path: Path) -> None:
    pipeline = slow_lease
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    client = redis_client(pipeline)
    pipeline.start_worker("hid", kind="hidden")  # a live worker: its reconciler heals
    victim = pipeline.start_worker("victim", DFLASH_TEST_FAULT="generate.hand_off=kill")
    enqueue(pipeline, tmp_path, "ho", rows=2, shard_size=2)
    victim.wait(timeout=300)
    fault = time.monotonic()
    assert victim.returncode == -signal.SIGKILL
    assert storage.exists(keys.generated_commit("ho", 0)), "killed before its commit"
    assert not client.hexists(HIDDEN.keys("ho").queued, keys.shard_name(0)), "handed off"
    wait_until(lambda: len(hidden_commits(storage, "ho")) == 1, deadline(fault, 3),
               "the hidden commit within 3 lease TTLs of the kill")
    print(f"\nkilled between commit and hand-off -> hidden commit: "
          f"{time.monotonic() - fault:.1f}s (lease TTL {TTL:.0f}s)")


def lose_message(client, queue: str, run: str, shard: int) -> None:  # noqa: ANN001
    for raw in client.lrange(queue, 0, -1):
        if (run, shard) in queued_in_one(raw):
            assert client.lrem(queue, 1, raw) == 1
            return
    raise AssertionError(f"no message for shard {shard} in {queue}")


def queued_in_one(raw: str) -> set[tuple[str, int]]:
    from common.queue.dispatch import _task_of

    task = _task_of(raw)
    return {(task.run, task.shard)} if task else set()


@pytest.mark.parametrize("fault", ["queue deleted", "message lost under its marker"])
def test_a_lost_hidden_message_heals(slow_lease: Pipeline, tmp_path: Path, fault: str) -> None:
    pipeline = slow_lease
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    client = redis_client(pipeline)
    pipeline.start_worker("hid", kind="hidden")
    consuming(pipeline, "hid", HIDDEN.queue, on=False)  # the hand-offs wait in the queue
    pipeline.start_worker("gen")
    enqueue(pipeline, tmp_path, "lost", rows=4, shard_size=2)
    pipeline.wait_done("lost")
    # A shard's hand-off follows its commit, so "done" can come a moment before the message.
    wait_until(lambda: queued_in(client, HIDDEN.queue) == {("lost", 0), ("lost", 1)}, 60,
               "both hand-offs waiting in the hidden queue")
    if fault == "queue deleted":
        client.delete(HIDDEN.queue)
    else:
        lose_message(client, HIDDEN.queue, "lost", 0)
    at = time.monotonic()
    assert client.hlen(HIDDEN.keys("lost").queued) == 2, "the markers stay behind"
    consuming(pipeline, "hid", HIDDEN.queue, on=True)
    wait_until(lambda: len(hidden_commits(storage, "lost")) == 2, deadline(at, 3),
               f"both hidden commits within 3 lease TTLs ({fault})")
    print(f"\n{fault} -> both hidden commits: {time.monotonic() - at:.1f}s "
          f"(lease TTL {TTL:.0f}s)")


def test_a_storage_403_parks_the_shard_with_the_services_reason(pipeline: Pipeline,
                                                                tmp_path: Path) -> None:
    import boto3

    bucket, _, prefix = pipeline.env["DFLASH_STORAGE"].removeprefix("s3://").partition("/")
    enqueue(pipeline, tmp_path, "deny", rows=4, shard_size=4)
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{bucket}/{prefix}/runs/deny/inputs/shard-*"}]}
    boto3.client("s3").put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
    pipeline.start_worker("gen")
    found = wait_until(lambda: parked(pipeline, "deny", "generate"), 60, "the shard parked")
    assert "403" in found[0]["reason"] and "inputs/shard-000000" in found[0]["reason"]
    attempts = int(redis_client(pipeline).hget(GENERATE.keys("deny").attempts,
                                               keys.shard_name(0)))
    assert attempts == 1, f"a permanent refusal was retried ({attempts} deliveries)"
    assert pipeline.status("deny")["state"] == "failed"


def test_a_killed_trainer_s_shard_is_queued_again_within_two_lease_ttls(
        slow_lease: Pipeline, tmp_path: Path) -> None:
    pipeline = slow_lease
    from common.queue.celery_app import TRAIN
    from common.runs.checkpoints import read_ledger
    from tests.test_train_e2e import TRAIN_ENV

    ttl = float(pipeline.env["DFLASH_LEASE_TTL"])
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    client = redis_client(pipeline)
    slow = {**TRAIN_ENV, "DFLASH_TRAIN_ROWS_PER_STEP": "1"}
    victim = pipeline.start_worker("victim", kind="train", **slow,
                                   DFLASH_TEST_FAULT="train.forward=sleep:1")
    pipeline.start_worker("gen")  # stays up: its reconciler heals the trainer's shard
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    pipeline.cli("enqueue", "--input", src, "--run", "tk", "--shard-size", "2", "--mode",
                 "online", "--epochs", "1", "--max-new-tokens", "32", *ANY_SAMPLE,
                 "--heldout-min", "0", "--heldout-fraction", "0", check=True)
    lease = TRAIN.lease_key("tk", 0)
    token = wait_until(lambda: client.get(lease), 300, "the trainer to lease a shard")
    shard = redis_keys.lease_shard(token)
    assert shard is not None, f"the run lease {token!r} does not name its shard"
    wait_until(lambda: client.hget(TRAIN.keys("tk").metrics, "step"), 300,
               "a first training step (the trainer is mid-shard)")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    fault = time.monotonic()
    assert shard not in read_ledger(storage, "tk").done, "the shard finished before the kill"

    def queued_again() -> bool:
        return ("tk", shard) in (queued_in(client, TRAIN.queue) or set())

    wait_until(queued_again, max(fault + 2 * ttl - time.monotonic(), 0.1),
               f"shard {shard} queued again within two lease TTLs of the kill")
    healed = time.monotonic() - fault
    pipeline.start_worker("rescuer", kind="train", **TRAIN_ENV)
    wait_until(lambda: sorted(read_ledger(storage, "tk").done) == [0, 1], 300,
               "both shards trained by the rescuer")
    print(f"\ntrainer kill -9 -> its shard queued again: {healed:.1f}s (lease TTL {ttl:.0f}s)")
