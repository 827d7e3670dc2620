"""The healer and the lease on a real Redis: lost shards come back once, live ones stay."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.celery_app import GENERATE, TRAIN, make_app
from common.config import load_settings
from common.keys import lease_is_live
from tests.conftest import RedisServer, wait_until
from workers.healer import heal_once
from workers.lease import Lease
from workers.stage import retry_marker


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    app = make_app(load_settings(env={"DFLASH_BROKER_URL": server.url}))
    yield server.client(), app
    server.kill()


def queued_tasks(client: Any, queue: str) -> int:
    return client.llen(queue)


def test_a_shard_running_without_a_lease_is_queued_again_once(env) -> None:
    client, app = env
    client.sadd(keys.redis_runs(), "r")
    names = GENERATE.keys("r")
    client.hset(names.running, keys.shard_name(3), "dead-worker:1")
    client.hset(names.running, keys.shard_name(4), "live-worker:1")
    with Lease(client, GENERATE.lease_key("r", 4), "live-worker:1", ttl=30):
        healed = heal_once(client, app, lease_ttl=1)
        assert healed == [("r", "generate", 3)]
        assert heal_once(client, app, lease_ttl=1) == [], "a second healer pass re-sent it"
    assert queued_tasks(client, GENERATE.queue) == 1
    assert client.hget(names.queued, keys.shard_name(3)) == "1"
    assert not client.hexists(names.running, keys.shard_name(3))
    assert client.hexists(names.running, keys.shard_name(4)), "a live shard was touched"
    # A shard that `resume` queued again meanwhile: its stale entry goes, nothing is re-sent.
    client.hdel(names.running, keys.shard_name(4))
    client.hset(names.running, keys.shard_name(5), "dead-worker:2")
    client.hset(names.queued, keys.shard_name(5), "1")
    assert heal_once(client, app, lease_ttl=1) == []
    assert not client.hexists(names.running, keys.shard_name(5))
    assert queued_tasks(client, GENERATE.queue) == 1


def test_an_overdue_retry_is_healed_but_a_due_one_is_not(env) -> None:
    client, app = env
    client.sadd(keys.redis_runs(), "r")
    names = TRAIN.keys("r")
    now = time.time()
    client.hset(names.queued, mapping={keys.shard_name(1): retry_marker(now - 3600),
                                       keys.shard_name(2): retry_marker(now + 5),
                                       keys.shard_name(3): "1"})
    assert heal_once(client, app, lease_ttl=1, now=now) == [("r", "train", 1)]
    assert queued_tasks(client, TRAIN.queue) == 1
    # While the run's one trainer holds its lease, nothing of the stage is healed.
    client.hset(names.queued, keys.shard_name(5), retry_marker(now - 3600))
    with Lease(client, TRAIN.lease_key("r", 5), "trainer:1", ttl=30):
        assert heal_once(client, app, lease_ttl=1, now=now) == []


def test_lease_is_retaken_after_a_wipe_and_lost_to_a_new_owner(env) -> None:
    client, _ = env
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


def test_a_task_taken_by_a_worker_that_died_before_starting_it_is_queued_again(env) -> None:
    import subprocess
    import sys

    from common.records import ShardTask
    from workers.healer import heal_unstarted

    client, app = env
    url = app.conf.broker_url
    client.hset(GENERATE.keys("r").queued, keys.shard_name(2), "1")  # as enqueue leaves it
    app.send_task(GENERATE.task_name, args=[ShardTask("r", 2).to_json()], queue=GENERATE.queue)
    taker = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom kombu import Connection\n"
         f"with Connection({url!r}) as c:\n q = c.SimpleQueue('generate')\n"
         " q.get(timeout=20)\n print('taken', flush=True)\n time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    assert taker.stdout.readline().strip() == "taken"
    taker.kill()  # kill -9: the message stays unacked until the visibility timeout
    taker.wait()
    assert queued_tasks(client, GENERATE.queue) == 0 and client.zcard("unacked_index") == 1
    assert heal_unstarted(client, app, grace=60, now=time.time()) == [], "healed too early"
    later = time.time() + 120
    assert heal_unstarted(client, app, grace=60, now=later) == [("r", "generate", 2)]
    assert heal_unstarted(client, app, grace=60, now=later) == [], "healed twice"
    assert queued_tasks(client, GENERATE.queue) == 1
    # A message whose shard a live worker holds, or whose retry waits, is left alone.
    client.hset(GENERATE.keys("r").queued, keys.shard_name(2), retry_marker(later))
    client.delete("dflash:healed:" + client.zrange("unacked_index", 0, 0)[0])
    assert heal_unstarted(client, app, grace=60, now=later) == []
