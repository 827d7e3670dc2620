"""Self-healing: every live worker re-queues shards whose worker died, without a human.

Each worker process runs one healer thread. Every half lease TTL it looks, for each run in
``dflash:runs`` and each stage, for shards that are ``running`` without a lease (their worker
was killed: the lease expired one TTL after its last heartbeat) and for retries long overdue
(the worker that held the retry died), and queues them again. A shard is so back in the queue
within about two lease TTLs of a ``kill -9``, whatever Celery's visibility timeout. Duplicate
deliveries are harmless: the lease keeps them apart and commits are put-once. ``resume`` stays
for a wiped Redis and for parked or paused shards.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready
from kombu.exceptions import OperationalError

from common import keys
from common.celery_app import STAGES, StageSpec
from common.celery_app import app as celery_app
from common.records import ShardTask
from workers.context import get_context
from workers.stage import retry_marker

log = logging.getLogger(__name__)

# KEYS: running, queued, lease. ARGV: field, owner seen. The owner must still be the one seen
# and hold no lease; then the shard moves to queued (one healer wins when several look), unless
# a task for it is queued already (``resume`` sent one): then only the stale entry goes.
_HEAL_RUNNING = """
if redis.call('exists', KEYS[3]) == 1 then return 0 end
if redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('hdel', KEYS[1], ARGV[1])
if redis.call('hget', KEYS[2], ARGV[1]) == '1' then return 2 end
redis.call('hset', KEYS[2], ARGV[1], '1')
return 1
"""
_SENT, _ALREADY_QUEUED = 1, 2
# KEYS: queued, lease. ARGV: field, marker seen.
_HEAL_RETRY = """
if redis.call('exists', KEYS[2]) == 1 then return 0 end
if redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('hset', KEYS[1], ARGV[1], '1')
return 1
"""


def retry_overdue(marker: str, now: float, grace: float) -> bool:
    kind, _, at = marker.partition(" ")
    try:
        return kind == "retry" and float(at) + grace < now
    except ValueError:
        return False


def heal_once(client: redis.Redis, app: Celery, lease_ttl: float,
              now: float | None = None) -> list[tuple[str, str, int]]:
    """One pass over every run and stage; returns the (run, stage, shard) queued again."""
    now = time.time() if now is None else now
    grace = max(2 * lease_ttl, 30.0)
    healed = []
    for run in sorted(client.smembers(keys.redis_runs())):
        for spec in STAGES:
            names = spec.keys(run)
            for field, owner in client.hgetall(names.running).items():
                shard = _shard(field)
                lease = spec.lease_key(run, shard)
                outcome = client.eval(_HEAL_RUNNING, 3, names.running, names.queued, lease,
                                      field, owner)
                if outcome == _ALREADY_QUEUED:
                    log.info("run %s shard %d (%s): worker %s lost; a task is queued already",
                             run, shard, spec.name, owner)
                elif outcome == _SENT:
                    log.warning("run %s shard %d (%s): worker %s lost (lease expired without "
                                "a commit); queued again", run, shard, spec.name, owner)
                    healed.append(_send(client, app, spec, run, shard))
            for field, marker in client.hgetall(names.queued).items():
                if not retry_overdue(marker, now, grace):
                    continue
                shard = _shard(field)
                lease = spec.lease_key(run, shard)
                if client.eval(_HEAL_RETRY, 2, names.queued, lease, field, marker):
                    log.warning("run %s shard %d (%s): retry overdue (its worker died); queued "
                                "again", run, shard, spec.name)
                    healed.append(_send(client, app, spec, run, shard))
    return healed


def _shard(field: str) -> int:
    return int(field.rsplit("-", 1)[-1])


def _send(client: redis.Redis, app: Celery, spec: StageSpec, run: str,
          shard: int) -> tuple[str, str, int]:
    try:
        app.send_task(spec.task_name, args=[ShardTask(run, shard).to_json()], queue=spec.queue)
    except OperationalError as err:
        # Broker trouble: mark it due again so the next pass tries once more.
        log.warning("run %s shard %d (%s): not queued again yet: %s", run, shard, spec.name, err)
        client.hset(spec.keys(run).queued, keys.shard_name(shard),
                    retry_marker(0))
    return run, spec.name, shard


class Healer(threading.Thread):
    """The worker's healing thread; stops when ``stopping`` is set."""

    def __init__(self, client: redis.Redis, app: Celery, lease_ttl: float,
                 stopping: threading.Event) -> None:
        super().__init__(name="healer", daemon=True)
        self.client, self.app, self.lease_ttl, self.stopping = client, app, lease_ttl, stopping

    def run(self) -> None:
        while not self.stopping.wait(self.lease_ttl / 2):
            try:
                heal_once(self.client, self.app, self.lease_ttl)
            except (redis.RedisError, OperationalError) as err:
                log.warning("healer pass skipped: %s", err)


@worker_ready.connect
def start_healer(**_: Any) -> Healer:
    """Start this worker process's healer once Celery says ready (every stage's worker)."""
    context = get_context()
    healer = Healer(context.redis, celery_app, context.settings.lease_ttl, context.stopping)
    healer.start()
    return healer
