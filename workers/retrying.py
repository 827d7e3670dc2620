"""Task retries that survive a broker restart.

Celery's ``Task.retry`` publishes the retry as a new message and, if that publish fails, rejects
the delivery without requeueing it: with a broker restarting under a worker the shard would be
dropped. :func:`retry_later` keeps trying on a fresh connection until the broker is back
(tenacity's capped exponential wait, 0.5 s doubling to 5 s, for up to ``BROKER_WAIT_S``).
"""

from __future__ import annotations

import logging
import random
from typing import NoReturn

from celery import Task
from celery.exceptions import Reject, Retry
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from common.queue.celery_app import app
from common.runs.records import ShardTask

log = logging.getLogger(__name__)

BROKER_WAIT_S = 600.0
_PAUSE_MAX_S = 5.0


def _reason(error: BaseException | None) -> object:
    """Why a publish was rejected (kombu's ``Reject`` carries a reason)."""
    return getattr(error, "reason", error)


def retry_later(task: Task, countdown: float, shard: ShardTask) -> NoReturn:
    """Raise Celery's ``Retry`` once the retry of ``shard`` is published."""
    what = f"run {shard.run} shard {shard.shard}"
    publish = Retrying(
        retry=retry_if_exception_type(Reject), stop=stop_after_delay(BROKER_WAIT_S),
        wait=wait_exponential(multiplier=0.5, max=_PAUSE_MAX_S), reraise=True,
        before_sleep=lambda state: log.warning(
            "%s: broker unreachable, retry not published yet (%r)", what,
            _reason(state.outcome.exception() if state.outcome else None)))
    try:
        raise publish(_publish_retry, task, countdown)
    except Reject as rejected:
        log.error("%s: retry not published for %.0fs (%r); `dflash-pipeline resume` queues it "
                  "again", what, BROKER_WAIT_S, rejected.reason)
        raise


def _publish_retry(task: Task, countdown: float) -> Retry:
    """One try on a fresh connection: ``Retry`` to raise once published, ``Reject`` if not."""
    with app.connection_for_write() as connection:
        return task.retry(countdown=countdown, connection=connection, throw=False)


def lease_wait(lease_ttl: float) -> float:
    """Retry delay for a shard whose lease another worker holds: half a TTL, jittered."""
    return lease_ttl / 2 + random.random()
