"""Celery entry point for the stages after generation: ``celery -A workers.downstream_app worker
-Q hidden`` (hidden states) or ``-Q train`` (drafter training).

Prefer ``dflash-pipeline worker hidden|train [--gpu N]``, which sets the queue, pool and name.
Both tasks are registered; a worker only takes the queue it was started on.
"""

from __future__ import annotations

import logging

from celery import bootsteps

from common.queue.celery_app import app
from workers import reconciler  # noqa: F401 - starts with the worker
from workers.context import get_context
from workers.hidden import task as hidden_task  # noqa: F401 - registers the task
from workers.train import task as train_task  # noqa: F401 - registers the task

log = logging.getLogger(__name__)


class StopShards(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """As the worker begins to stop (before its consumer and pool do), the shard in flight
    stops at its next batch or step and goes back to the queue."""

    requires = ("celery.worker.components:Pool",)

    def close(self, worker: object) -> None:
        log.info("worker shutting down: the shard in flight is requeued")
        get_context().stopping.set()


app.steps["worker"].add(StopShards)

__all__ = ["StopShards", "app"]
