"""Celery entry point for workers: ``celery -A workers.app worker -Q generate``.

Prefer ``dflash-pipeline worker generate``, which sets the pool, name and queue for you.
"""

from __future__ import annotations

import logging

from celery.signals import worker_init

from common.celery_app import app
from workers import generate  # noqa: F401 - registers the tasks
from workers.context import warm_engine

log = logging.getLogger(__name__)


@worker_init.connect
def _load_engine(**_: object) -> None:
    """Load the engine when the worker starts, so the first shard does not wait for it."""
    warm_engine()


__all__ = ["app"]
