"""Self-healing: every live worker re-queues shards whose worker died, without a human.

Each worker process runs one healer thread. Every half lease TTL it looks, for each run in
``dflash:runs`` and each stage, for shards that are ``running`` without a lease (their worker
was killed: the lease expired one TTL after its last heartbeat), for retries long overdue
(the worker that held the retry died), and for task messages a worker took from the queue
but died before starting (they sit in the broker's unacked set until the visibility timeout),
and queues them again. A shard is so back in the queue
within about two lease TTLs of a ``kill -9``, whatever Celery's visibility timeout. Duplicate
deliveries are harmless: the lease keeps them apart and commits are put-once. ``resume`` stays
for a wiped Redis and for parked or paused shards.
"""

from __future__ import annotations

import base64
import json
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
    return healed + heal_unstarted(client, app, grace, now)


# Kombu's Redis transport keeps messages delivered but not acked here, with delivery times.
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"
_BY_TASK = {spec.task_name: spec for spec in STAGES}
HEALED_TTL_S = 24 * 3600


def heal_unstarted(client: redis.Redis, app: Celery, grace: float,
                   now: float) -> list[tuple[str, str, int]]:
    """Messages delivered over ``grace`` ago whose shard no worker started: queue them again.

    A live worker starts a message it took at once (prefetch 1), and a retry waiting for its
    countdown carries a ``retry`` marker instead of ``1``; what is left lost its worker.
    """
    healed = []
    for tag in client.zrangebyscore(UNACKED_INDEX, "-inf", now - grace):
        found = _task_of(client.hget(UNACKED, tag))
        if found is None:
            continue
        spec, task = found
        names, field = spec.keys(task.run), keys.shard_name(task.shard)
        if (client.hget(names.queued, field) != "1" or client.hexists(names.running, field)
                or client.exists(spec.lease_key(task.run, task.shard))):
            continue
        # One healer per message: the marker lives as long as the message could stay unacked.
        if not client.set(f"dflash:healed:{tag}", "1", nx=True, ex=HEALED_TTL_S):
            continue
        log.warning("run %s shard %d (%s): its worker took the task and died before starting "
                    "it; queued again", task.run, task.shard, spec.name)
        healed.append(_send(client, app, spec, task.run, task.shard))
    return healed


def _task_of(raw: str | None) -> tuple[StageSpec, ShardTask] | None:
    """The stage and shard of an unacked Celery message (protocol 2, JSON), if it is ours."""
    try:
        message = json.loads(raw)[0]
        spec = _BY_TASK.get(message["headers"]["task"])
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return (spec, ShardTask.from_json(args[0])) if spec is not None else None
    except (TypeError, ValueError, KeyError, IndexError):
        return None


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
