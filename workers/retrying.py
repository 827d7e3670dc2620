"""Task retries that survive a broker restart.

Celery's ``Task.retry`` publishes the retry as a new message and, if that publish fails, rejects
the delivery without requeueing it: with a broker restarting under a worker the shard would be
dropped. :func:`retry_later` keeps trying on a fresh connection until the broker is back.
"""

from __future__ import annotations

import logging
import random
import time
from typing import NoReturn

from celery import Task
from celery.exceptions import Reject

from common.celery_app import app
from common.records import ShardTask

log = logging.getLogger(__name__)

BROKER_WAIT_S = 600.0
_PAUSE_MAX_S = 5.0


def retry_later(task: Task, countdown: float, shard: ShardTask) -> NoReturn:
    """Raise Celery's ``Retry`` once the retry of ``shard`` is published."""
    what = f"run {shard.run} shard {shard.shard}"
    deadline = time.monotonic() + BROKER_WAIT_S
    pause = 0.5
    while True:
        try:
            with app.connection_for_write() as connection:
                raise task.retry(countdown=countdown, connection=connection)
        except Reject as rejected:
            if time.monotonic() >= deadline:
                log.error("%s: retry not published for %.0fs (%r); `dflash-pipeline resume` "
                          "queues it again", what, BROKER_WAIT_S, rejected.reason)
                raise
            log.warning("%s: broker unreachable, retry not published yet (%r)", what,
                        rejected.reason)
            time.sleep(pause)
            pause = min(_PAUSE_MAX_S, pause * 2)


def lease_wait(lease_ttl: float) -> float:
    """Retry delay for a shard whose lease another worker holds: half a TTL, jittered."""
    return lease_ttl / 2 + random.random()
