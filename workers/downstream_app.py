"""Celery entry point for the stages after generation: ``celery -A workers.downstream_app worker
-Q hidden`` (hidden states) or ``-Q train`` (drafter training).

Prefer ``dflash-pipeline worker hidden|train [--gpu N]``, which sets the queue, pool and name.
Both tasks are registered; a worker only takes the queue it was started on.
"""

from __future__ import annotations

import logging

from celery.signals import worker_shutting_down

from common.queue.celery_app import app
from workers import reconciler  # noqa: F401 - starts with the worker
from workers.context import get_context
from workers.hidden import task as hidden_task  # noqa: F401 - registers the task
from workers.train import task as train_task  # noqa: F401 - registers the task

log = logging.getLogger(__name__)


@worker_shutting_down.connect
def _stop_shards(**_: object) -> None:
    """The shard in flight stops at its next batch or step and goes back to the queue."""
    log.info("worker shutting down: the shard in flight is requeued")
    get_context().stopping.set()


__all__ = ["app"]
