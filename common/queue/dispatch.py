"""Publishing a shard task and knowing cheaply whether one is still queued.

One function, :func:`publish_shard`, sends every shard task (enqueue, resume, the workers'
hand-off, the reconciler): the message first, then the ``queued`` marker, so a marker never
claims a message that was not sent. A marker is ``<kind> <epoch>``:

- ``queued T``: published at T. Trusted while T is younger than one lease TTL (a worker may
  have taken the message and not started it yet); after that only if the message is found in
  the stage's queue (``LRANGE``, for queues up to :data:`QUEUE_SCAN_MAX` messages) or the queue
  is too long to scan. A marker whose message was lost (a deleted queue, Redis's last second of
  AOF) so ages out in one TTL once its queue is short.
- ``retry T``: a countdown retry is due at T; the worker holding it (Celery keeps ETA messages
  out of the queue, unacked) starts it then. Trusted until T plus one TTL, and in a one-per-run
  stage (train) while the run's lease is live.
- ``started T``: a delivery began at T and has not taken its lease yet (storage reads before
  the claim). Trusted for two TTLs.

Why not Celery's unacked hash: it is kombu's internal layout and says nothing about retries a
live worker holds; the queue's list is Celery's public contract for a waiting message.
"""

from __future__ import annotations

import base64

import redis
from celery import Celery

from common.errors import ForeignObject
from common.json_parse import parse
from common.queue.celery_app import StageSpec
from common.queue.markers import QUEUED, RETRY, STARTED, Marker, marker
from common.runs.records import ShardTask

__all__ = ["QUEUED", "RETRY", "STARTED", "Marker", "marker", "publish_shard", "queued_in"]

QUEUE_SCAN_MAX = 2000
"""Longer queues are not read: their markers are trusted until the queue is shorter."""

RETRY_POLICY = {"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2}
"""Rides out a broker blip of a few seconds, then fails: the CLI exits with one line, and a
worker's hand-off is healed by the reconciler from storage, so nobody waits on a dead broker
(the policy also covers Celery's task-sent event, published the same way)."""

def publish_shard(app: Celery, client: redis.Redis, spec: StageSpec, run: str, shard: int,
                  *, fresh: bool = False) -> None:
    """Mark one shard queued, then send its task; ``fresh`` forgets a parking.

    In that order: a worker may take the message before a later write lands, and a fresh count
    cleared after its first delivery was counted would park it again at once (a cap of 1). A
    marker whose message never went out (the broker refused it) stops holding after one lease
    TTL, and the reconciler queues the shard again.
    """
    spec.registry(client, run).hand_over(shard, fresh=fresh)
    app.send_task(spec.task_name, args=[ShardTask(run, shard).to_json()], queue=spec.queue,
                  retry=True, retry_policy=RETRY_POLICY)


def queued_in(client: redis.Redis, queue: str) -> set[tuple[str, int]] | None:
    """(run, shard) of every message waiting in ``queue``; None when it is too long to read."""
    if client.llen(queue) > QUEUE_SCAN_MAX:
        return None
    found = set()
    for raw in client.lrange(queue, 0, QUEUE_SCAN_MAX):
        task = _task_of(raw)
        if task is not None:
            found.add((task.run, task.shard))
    return found


def _task_of(raw: str | bytes) -> ShardTask | None:
    """The shard of a Celery message (protocol 2, JSON) as kombu's Redis transport stores it."""
    try:
        message = parse("a queued message", raw)   # any role with broker access writes these
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return ShardTask.from_json(parse("a queued message", body)[0][0])
    except (ForeignObject, TypeError, ValueError, KeyError, IndexError, AttributeError):
        return None
