"""The reconciler and the lease on a real Redis and local storage: what storage says is due and
nobody owns is queued once; owned, parked and done shards are left alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.config import load_settings
from common.queue import redis_keys
from common.queue.celery_app import GENERATE, HIDDEN, TRAIN, make_app
from common.queue.dispatch import RETRY, marker, publish_shard, queued_in
from common.queue.reconcile import Flags, reconcile
from common.queue.redis_keys import lease_is_live
from common.runs.records import InputManifest, RunConfig, ShardCommit, dumps
from common.storage import open_storage
from tests.conftest import RedisServer, wait_until
from tests.test_commit_proof import hidden_commit_body
from workers.lease import Lease

TTL = 1.0


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Any, Any, Any]]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    app = make_app(load_settings(env={"DFLASH_BROKER_URL": server.url}))
    yield open_storage(str(tmp_path / "store")), server.client(), app
    server.kill()


def make_run(storage: Any, client: Any, run: str, shards: int, generated: set[int],
             mode: str = "offline") -> None:
    """A run as enqueue leaves it: run.json, the manifest, and some generate commits."""
    config = RunConfig(run=run, model="m", input="x.jsonl", format="auto", prompt_field=None,
                       shard_size=1, limit=None, mode=mode)
    storage.put_once(keys.run_config(run), dumps(config.to_json()))
    manifest = InputManifest(shards=shards, rows=shards, rejected=0, shard_rows=[1] * shards)
    storage.put_once(keys.inputs_manifest(run), dumps(manifest.to_json()))
    for shard in generated:
        commit = ShardCommit(run, shard, [], [f"{run}-{shard}"], {}, {}, "w")
        storage.put_once(keys.generated_commit(run, shard), dumps(commit.to_json()))
    client.sadd(redis_keys.redis_runs(), run)


def messages(client: Any, queue: str) -> list[tuple[str, int]]:
    return sorted(queued_in(client, queue) or [])


def test_due_unowned_shards_are_queued_once_and_owned_ones_are_left(env) -> None:
    storage, client, app = env
    make_run(storage, client, "r", shards=4, generated={0, 1, 2})
    storage.put_once(keys.hidden_commit("r", 2), hidden_commit_body("r", 2))   # done: not due
    client.hset(GENERATE.keys("r").parked, keys.shard_name(3), "bad input")
    client.hset(HIDDEN.keys("r").running, keys.shard_name(1), "dead:1:shard-000001")
    with Lease(client, HIDDEN.lease_key("r", 0), redis_keys.lease_owner("live", "1", 0), ttl=30):
        assert reconcile(storage, app, client, TTL) == {"r": [("hidden", 1)]}
        assert reconcile(storage, app, client, TTL) == {"r": []}, "queued twice"
    assert messages(client, HIDDEN.queue) == [("r", 1)]
    assert messages(client, GENERATE.queue) == [], "a parked shard was queued"
    assert not client.hexists(HIDDEN.keys("r").running, keys.shard_name(1))
    # resume's flags: the parked shard comes back with a fresh count; the live lease is gone now.
    client.hset(GENERATE.keys("r").attempts, keys.shard_name(3), 5)
    sent = reconcile(storage, app, client, TTL, runs=["r"], flags=Flags(parked=True), wait_s=5)
    assert sent == {"r": [("generate", 3), ("hidden", 0)]}
    assert not client.hexists(GENERATE.keys("r").attempts, keys.shard_name(3))


def test_a_marker_without_a_message_ages_out_and_a_retry_waits_for_its_time(env) -> None:
    storage, client, app = env
    make_run(storage, client, "m", shards=3, generated={0, 1, 2})
    names = HIDDEN.keys("m")
    publish_shard(app, client, HIDDEN, "m", 0)   # a real message: stays owned
    client.hset(names.queued, keys.shard_name(1), marker("queued", time.time()))  # no message
    client.hset(names.queued, keys.shard_name(2), marker(RETRY, time.time() + 2 * TTL))
    assert reconcile(storage, app, client, TTL) == {"m": []}, "a fresh marker was not trusted"
    time.sleep(TTL * 1.2)
    assert reconcile(storage, app, client, TTL) == {"m": [("hidden", 1)]}
    time.sleep(TTL * 2)
    assert reconcile(storage, app, client, TTL) == {"m": [("hidden", 2)]}
    assert messages(client, HIDDEN.queue) == [("m", 0), ("m", 1), ("m", 2)]
    client.delete(HIDDEN.queue)  # the queue is lost: every marker ages out once
    time.sleep(TTL * 1.2)
    assert sorted(reconcile(storage, app, client, TTL)["m"]) == [("hidden", s) for s in range(3)]


def test_two_reconcilers_at_once_never_queue_a_shard_twice(env) -> None:
    storage, client, app = env
    for run in ("a", "b"):
        make_run(storage, client, run, shards=30, generated=set(range(30)), mode="online")
    start = threading.Barrier(4)
    results: list[Any] = []

    def one_pass() -> None:
        start.wait()
        for _ in range(5):
            results.append(reconcile(storage, app, client, TTL))

    threads = [threading.Thread(target=one_pass) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sent = [m for m in client.lrange(TRAIN.queue, 0, -1)]
    assert len(sent) == 60 and len(set(messages(client, TRAIN.queue))) == 60
    assert sum(len(r[run]) for r in results if r for run in r) == 60


def test_a_run_lease_covers_only_the_shard_it_names(env) -> None:
    storage, client, app = env
    make_run(storage, client, "t", shards=3, generated={0, 1, 2}, mode="online")
    # Shard 2 waits for the run lease: its retry is overdue, but the trainer is busy.
    client.hset(TRAIN.keys("t").queued, keys.shard_name(2), marker(RETRY, time.time() - 60))
    with Lease(client, TRAIN.lease_key("t", 0), redis_keys.lease_owner("trainer", "1", 0), ttl=30):
        assert reconcile(storage, app, client, TTL) == {"t": [("train", 1)]}
    # Its trainer gone (the lease released or expired), the untrained shard is due again.
    assert reconcile(storage, app, client, TTL) == {"t": [("train", 0), ("train", 2)]}
    assert reconcile(storage, app, client, TTL) == {"t": []}


def test_lease_is_retaken_after_a_wipe_and_lost_to_a_new_owner(env) -> None:
    _, client, _ = env
    key = GENERATE.lease_key("r", 0)
    with Lease(client, key, "a:1", ttl=0.6) as lease:
        token = client.get(key)
        assert lease_is_live(token, client.pttl(key))
        client.flushall()
        wait_until(lambda: client.get(key) == token, 5, "the heartbeat to re-take the lease")
        lease.check()  # still ours
        client.set(key, "b:2 600")
        wait_until(lambda: lease.lost, 5, "the heartbeat to notice the new owner")
    assert client.get(key) == "b:2 600", "releasing must not delete another owner's lease"
    assert not lease_is_live("x 60000", 10_000), "a lease two beats late is not live"


def test_the_dashboard_grid_is_the_status_count_and_a_run_nobody_holds_is_stalled(env) -> None:
    from producer.status import StatusReader
    from producer.ui.views import Views

    storage, client, _ = env
    make_run(storage, client, "g", shards=6, generated={0})
    names = GENERATE.keys("g")
    client.hset(names.running, mapping={keys.shard_name(1): "w:1:shard-000001",
                                        keys.shard_name(2): "dead:2:shard-000002"})
    client.hset(names.queued, keys.shard_name(3), marker(RETRY, time.time() + 600))
    client.hset(names.parked, keys.shard_name(4), "bad input")
    views = Views(storage, client)
    with Lease(client, GENERATE.lease_key("g", 1), "w:1:shard-000001", ttl=30):
        status = StatusReader(storage, client, "g").read()
        grid = views.shards("g")["shards"]
    assert [c["state"] for c in grid] == ["committed", "running", "healing", "retrying",
                                          "parked", "pending"]
    for state in ("committed", "running", "healing", "retrying", "parked", "pending"):
        assert sum(c["state"] == state for c in grid) == status["shards"][state], state
    assert status["state"] == "running"
    client.hset(names.queued, keys.shard_name(3), marker(RETRY, time.time() - 3600))
    assert StatusReader(storage, client, "g").read()["state"] == "stalled"
