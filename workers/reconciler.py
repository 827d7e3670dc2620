"""The worker side of the reconciler: every worker process offers to run the pass.

Every half lease TTL each worker tries the reconciler lock
(:func:`common.queue.reconcile.reconcile`, non-blocking): the one that gets it runs the pass, the
others skip it. A killed worker's shard (its lease expired), a lost hand-off or a lost message is
so queued again within about two lease TTLs, whatever Celery's visibility timeout, as long as any
worker of any stage lives.
"""

from __future__ import annotations

import logging
import threading

import redis
from celery import Celery, bootsteps
from kombu.exceptions import OperationalError

from common.errors import DflashError
from common.queue.celery_app import app as celery_app
from common.queue.reconcile import reconcile
from common.storage import Storage
from workers.context import get_context

log = logging.getLogger(__name__)


class Reconciler(threading.Thread):
    """The worker's reconciler thread; stops when ``stopping`` is set."""

    def __init__(self, storage: Storage, client: redis.Redis, app: Celery, lease_ttl: float,
                 stopping: threading.Event) -> None:
        super().__init__(name="reconciler", daemon=True)
        self.storage, self.client, self.app = storage, client, app
        self.lease_ttl, self.stopping = lease_ttl, stopping

    def run(self) -> None:
        """A pass every half lease TTL until the worker stops; no exception ends the thread (a
        pass that fails is logged, and the next one runs on time)."""
        while not self.stopping.wait(self.lease_ttl / 2):
            try:
                reconcile(self.storage, self.app, self.client, self.lease_ttl)
            except (redis.RedisError, OperationalError, DflashError) as err:
                log.warning("reconciler pass skipped: %s", err)
            except Exception:  # noqa: BLE001 - the thread that heals must outlive any bug
                log.exception("reconciler pass failed; the thread goes on, the next pass in "
                              "%.0f s", self.lease_ttl / 2)


class ReconcilerStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """Starts this worker process's reconciler thread as the worker starts (every stage); the
    thread ends when the worker's ``stopping`` is set."""

    requires = ("celery.worker.components:Pool",)

    def start(self, worker: object) -> None:
        start_reconciler()


def start_reconciler() -> Reconciler:
    context = get_context()
    thread = Reconciler(context.storage, context.redis, celery_app,
                        context.settings.worker.lease_ttl, context.stopping)
    thread.start()
    return thread


celery_app.steps["worker"].add(ReconcilerStep)
