"""Celery entry point for the drafter trainer: ``celery -A workers.train_app worker -Q train``.

Prefer ``dflash-pipeline worker train [--gpu N]``, which sets the queue, pool and name.
"""

from __future__ import annotations

import logging

from celery.signals import worker_shutting_down

from common.celery_app import app
from workers import train  # noqa: F401 - registers the train task
from workers.context import get_context

log = logging.getLogger(__name__)


@worker_shutting_down.connect
def _stop_training(**_: object) -> None:
    """The shard in flight stops before its next step and goes back to the queue."""
    log.info("train worker shutting down: the shard in flight is requeued")
    get_context().stopping.set()


__all__ = ["app"]
