"""Celery entry point for hidden-state workers: ``celery -A workers.hidden_app worker -Q hidden``.

Prefer ``dflash-pipeline worker hidden [--gpu N]``, which sets the queue, pool and name.
"""

from __future__ import annotations

import logging

from celery.signals import worker_shutting_down

from common.celery_app import app
from workers import hidden  # noqa: F401 - registers the hidden task
from workers.context import get_context

log = logging.getLogger(__name__)


@worker_shutting_down.connect
def _stop_shards(**_: object) -> None:
    """A shard in flight stops at its next batch and goes back to the queue."""
    log.info("hidden worker shutting down: the shard in flight is requeued")
    get_context().stopping.set()


__all__ = ["app"]
