"""Celery entry point for workers: ``celery -A workers.generate.app worker -Q generate``.

Prefer ``dflash-pipeline worker generate``, which sets the pool, name and queue for you. The
worker's start-up and shut-down are Celery bootsteps: :class:`EngineStep` (load, say, stop the
shards) and :class:`EngineCloser` (stop the engine once the pool has).
"""

from __future__ import annotations

import gc
import logging

from celery import bootsteps

from common.errors import DflashError
from common.queue.celery_app import app
from workers import reconciler  # noqa: F401 - starts with the worker
from workers.context import get_context
from workers.generate import metrics
from workers.generate import task as generate_task  # noqa: F401 - registers the task
from workers.generate.context import get_generate_context, warm_engine

log = logging.getLogger(__name__)


def load_engine(hostname: str | None) -> None:
    """Load the engine as the worker is built; a worker without an engine must not take shards."""
    try:
        warm_engine(hostname)
    except (DflashError, OSError) as exc:
        log.critical("engine failed to start: %s", exc)
        # Out of the worker's constructor, as Celery's own start-up errors leave it.
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


class EngineStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """The worker's engine: loaded when the worker is built (before its pool takes a shard), its
    MTP line said at start, and shards in flight told to flush and requeue as the worker stops."""

    requires = ("celery.worker.components:Pool",)

    def create(self, worker: object) -> None:
        load_engine(getattr(worker, "hostname", None))

    def start(self, worker: object) -> None:
        """The worker's line on MTP as its engine starts (which, and why), once Celery's logging
        is set up; each run then logs its own choice at its first task."""
        mtp = get_generate_context().engine.mtp
        if mtp is not None:
            log.info("engine starts with %s", mtp.line())

    def close(self, worker: object) -> None:
        """The worker begins to stop (before its consumer and pool do): shards in flight flush
        their last part and requeue instead of running to the end."""
        log.info("worker shutting down: shards in flight flush and requeue")
        get_context().stopping.set()


class EngineCloser(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """Stops the engine server (its whole process tree) after the last shard flushed: Celery
    shuts the consumer's steps down once every worker step, the pool included, has stopped."""

    def shutdown(self, consumer: object) -> None:
        get_generate_context().close_engine()


app.steps["worker"].add(EngineStep)
app.steps["consumer"].add(EngineCloser)

__all__ = ["EngineCloser", "EngineStep", "app"]
