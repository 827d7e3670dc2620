"""Celery entry point for workers: ``celery -A workers.generate.app worker -Q generate``.

Prefer ``dflash-pipeline worker generate``, which sets the pool, name and queue for you.
"""

from __future__ import annotations

import gc
import logging

from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down

from common.errors import DflashError
from common.queue.celery_app import app
from workers import reconciler  # noqa: F401 - starts with the worker
from workers.context import get_context
from workers.generate import metrics
from workers.generate import task as generate_task  # noqa: F401 - registers the task
from workers.generate.context import get_generate_context, warm_engine

log = logging.getLogger(__name__)


@worker_init.connect
def _load_engine(sender: object = None, **_: object) -> None:
    """Load the engine when the worker starts; a worker without an engine must not take shards."""
    try:
        warm_engine(getattr(sender, "hostname", None))
    except (DflashError, OSError) as exc:
        log.critical("engine failed to start: %s", exc)
        # SystemExit passes through Celery's signal dispatch, which swallows Exceptions.
        raise SystemExit(f"engine failed to start: {exc}") from exc
    # Everything loaded so far (transformers, torch, the tokenizer) lives as long as the worker:
    # out of the collector's sight, full collections stop walking it between requests.
    gc.freeze()
    context = get_generate_context()
    settings = context.worker.settings
    port, host = settings.worker.metrics_port, settings.worker.metrics_host
    if port:
        try:
            metrics.serve(host, port, lambda: float(context.current.in_flight
                                                      if context.current else 0))
        except OSError as exc:
            raise SystemExit(f"cannot serve metrics on {host}:{port}: {exc}") from exc


@worker_ready.connect
def _say_mtp(**_: object) -> None:
    """The worker's line on MTP as its engine starts (which, and why), once Celery's logging is
    set up; each run then logs its own choice at its first task."""
    mtp = get_generate_context().engine.mtp
    if mtp is not None:
        log.info("engine starts with %s", mtp.line())


@worker_shutting_down.connect
def _stop_shards(**_: object) -> None:
    """Shards in flight flush their last part and requeue instead of running to the end."""
    log.info("worker shutting down: shards in flight flush and requeue")
    get_context().stopping.set()


@worker_shutdown.connect
def _close_engine(**_: object) -> None:
    """Stop the engine server (its whole process tree) after the last shard flushed."""
    get_generate_context().close_engine()


__all__ = ["app"]
