"""The shard-stage skeleton every stage task runs in: lease, attempts, delivery cap, parking,
capped-backoff retry, give-back on shutdown or pause, and a catch-all that parks.

A stage task's body is one call; the stage supplies only its ``process`` function, which does
its work inside ``with delivery.claim() as lease:``::

    @app.task(name=TASK_HIDDEN, bind=True, max_retries=None)
    def hidden_shard(self, payload):
        return run_delivery(self, HIDDEN, payload, process_hidden)

Every stage keeps the same Redis registries, with the same operations on them
(:class:`common.queue.shard_registry.ShardRegistry`), so ``status``, ``resume`` and the
reconciler (:mod:`common.queue.reconcile`) treat generate, hidden and train alike.
A delivery counts itself before it reads anything, so the delivery cap parks a shard whatever
fails; the hand-off to the next stage is a step here, run after a commit and also when a
redelivery finds the shard committed, before the lease is let go.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Task
from kombu.exceptions import OperationalError

from common import keys
from common.choices import TaskOutcome
from common.errors import (
    LeaseBusy,
    LeaseLost,
    MalformedName,
    PermanentError,
    RunPaused,
    ShuttingDown,
    StorageError,
    TransientError,
)
from common.faults import inject
from common.queue import redis_keys
from common.queue.celery_app import GENERATE, HIDDEN, STAGES, TRAIN, StageSpec, app
from common.queue.dispatch import RETRY, marker, publish_shard
from common.queue.shard_registry import ShardRegistry
from common.runs.records import ShardTask, dumps
from workers.context import WorkerContext, get_context
from workers.lease import Lease
from workers.retrying import lease_wait, retry_later

log = logging.getLogger(__name__)

__all__ = ["GENERATE", "HIDDEN", "STAGES", "TRAIN", "Delivery", "StageSpec", "run_delivery"]

TRANSIENT = (TransientError, redis.RedisError, OSError, OperationalError)
"""Failures outside the shard: retried with capped backoff, parked after the delivery cap."""


class DeliveryCapReached(PermanentError):
    """The shard was started too many times without finishing (its workers died each time)."""


@dataclass
class Delivery:
    """One delivery of one shard to one stage: its bookkeeping in the stage's registries."""

    ctx: WorkerContext
    spec: StageSpec
    task: ShardTask
    worker: str
    owner: str = field(init=False)
    _held: ExitStack = field(init=False, default_factory=ExitStack)
    _claimed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.owner = redis_keys.lease_owner(self.worker, uuid.uuid4().hex[:8], self.task.shard)

    @property
    def registry(self) -> ShardRegistry:
        return self.spec.registry(self.ctx.redis, self.task.run)

    @property
    def what(self) -> str:
        return f"run {self.task.run} shard {self.task.shard} ({self.spec.name})"

    def begin(self) -> None:
        """Count the delivery before anything is read: the cap then holds whatever fails."""
        attempts = self.registry.begin(self.task.shard)
        if attempts > self.ctx.settings.worker.max_deliveries:
            raise DeliveryCapReached(f"started {attempts - 1} times without committing "
                                     "(worker killed or lost each time)")

    @contextmanager
    def holding(self) -> Iterator[None]:
        """The delivery's scope: the lease taken by :meth:`claim` is released only on exit, after
        the hand-off; a failure leaves the shard marked for redelivery."""
        try:
            with self._held:
                try:
                    yield
                except BaseException as exc:
                    if self._claimed:  # LeaseLost: the bookkeeping belongs to the new owner
                        self._settle(marker(RETRY, time.time())
                                     if not isinstance(exc, LeaseLost) else "")
                    raise
        finally:
            self._claimed = False

    @contextmanager
    def claim(self) -> Iterator[Lease]:
        """Hold the lease (until the delivery ends) and show the shard running."""
        lease_key = self.spec.lease_key(self.task.run, self.task.shard)
        lease = self._held.enter_context(
            Lease(self.ctx.redis, lease_key, self.owner, self.ctx.settings.worker.lease_ttl))
        self.registry.start(self.task.shard, self.owner)
        self._claimed = True
        yield lease

    def finish(self) -> None:
        """The shard is done here (and handed off): forget its running entry and attempts."""
        if self._claimed:
            self._settle("")
            self._claimed = False
        self.forget_attempts()

    def _settle(self, mark: str) -> None:
        try:
            self.registry.settle(self.task.shard, self.owner, mark)
        except redis.RedisError as err:  # the reconciler requeues it once Redis is back
            log.warning("%s: bookkeeping not updated: %s", self.what, err)

    def attempts(self) -> int:
        """Deliveries started so far; 0 when Redis is unreachable (the failure being handled)."""
        try:
            return self.registry.attempts(self.task.shard)
        except redis.RedisError:
            return 0

    def forget_attempts(self) -> None:
        try:
            self.registry.forget_attempts(self.task.shard)
        except redis.RedisError as err:
            log.warning("%s: attempt count not cleared: %s", self.what, err)

    def give_back_attempt(self) -> None:
        """A stop or pause is not the shard's fault: it does not count toward the cap."""
        try:
            self.registry.give_back_attempt(self.task.shard)
        except redis.RedisError as err:
            log.warning("%s: attempt not given back: %s", self.what, err)

    def unqueue(self) -> None:
        """Forget the queued marker (the shard is done, paused or parked; resume re-queues)."""
        try:
            self.registry.unqueue(self.task.shard)
        except redis.RedisError as err:
            log.warning("%s: queued marker not cleared: %s", self.what, err)

    def retry(self, celery_task: Task, countdown: float) -> None:
        """Publish the retry (waiting out a broker restart); the marker says when it is due."""
        try:
            self.registry.mark_retry(self.task.shard, time.time() + countdown)
        except redis.RedisError as err:
            log.warning("%s: retry marker not set: %s", self.what, err)
        retry_later(celery_task, countdown, self.task)

    def park(self, reason: str) -> TaskOutcome:
        """Stop redelivering the shard; status shows the reason, ``resume`` tries it again."""
        log.error("%s: parked: %s", self.what, reason)
        stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
        record = {"run": self.task.run, "shard": self.task.shard, "stage": self.spec.name,
                  "reason": reason, "at": time.time()}
        try:
            self.ctx.storage.put_once(keys.failed_shard(self.task.run, self.task.shard, stamp,
                                                        self.spec.name), dumps(record))
        except StorageError as err:
            log.warning("%s: parking record not stored: %s", self.what, err)
        try:
            self.registry.park(self.task.shard, reason)
        except redis.RedisError as err:
            log.error("%s: parking not recorded in Redis: %s", self.what, err)
        return TaskOutcome.PARKED


Process = Callable[[Delivery], TaskOutcome]
HandOff = Callable[[Delivery], None]
_DONE = (TaskOutcome.COMMITTED, TaskOutcome.ALREADY_COMMITTED)


def run_delivery(celery_task: Task, spec: StageSpec, payload: dict[str, Any],
                 process: Process, hand_off: HandOff | None = None) -> dict[str, Any]:
    """Run one delivery: count it, ``process`` it, hand the shard off if it is (or was) committed,
    and decide what happens to the shard if any step fails."""
    try:
        task = ShardTask.from_json(payload)
    except MalformedName as bad:   # checked at receipt: no key of any run is touched
        log.error("%s task refused: %s", spec.name, bad)
        return {"stage": spec.name, "outcome": TaskOutcome.REFUSED}
    ctx = get_context()
    delivery = Delivery(ctx, spec, task, celery_task.request.hostname or spec.name)
    what = delivery.what
    try:
        with delivery.holding():
            delivery.begin()
            outcome = process(delivery)
            if outcome in _DONE and hand_off is not None:
                inject(f"{spec.name}.hand_off")
                hand_off(delivery)  # inside the lease: the reconciler leaves the shard to us
            if outcome in _DONE:
                delivery.finish()
    except ShuttingDown as stop:
        log.info("%s: %s; requeued", what, stop)
        delivery.give_back_attempt()
        delivery.retry(celery_task, 1)
    except RunPaused as paused:
        # Acked, not retried: `resume --accept-gates` queues the shard again.
        log.warning("%s: %s; stopped", what, paused)
        outcome = TaskOutcome.PAUSED
    except LeaseBusy as busy:
        log.info("%s: %s; retrying later", what, busy)
        delivery.give_back_attempt()  # waiting for a live owner is not the shard's failure
        delivery.retry(celery_task, lease_wait(ctx.settings.worker.lease_ttl))
    except LeaseLost as lost:
        log.warning("%s: %s; left to its new owner", what, lost)
        outcome = TaskOutcome.LOST
    except PermanentError as exc:
        outcome = delivery.park(str(exc))
    except TRANSIENT as exc:
        attempts = delivery.attempts()
        if attempts >= ctx.settings.worker.max_deliveries:
            outcome = delivery.park(f"failed {attempts} times, last: {exc!r}")
        else:
            delay = min(ctx.settings.worker.retry_backoff_max, 2.0**attempts)
            log.warning("%s: attempt %d failed (%r); retry in %.0fs", what, attempts, exc, delay)
            delivery.retry(celery_task, delay)
    except Exception as exc:  # a bug or an OOM does not fix itself by retrying: park the shard
        log.exception("%s: unexpected error", what)
        outcome = delivery.park(f"unexpected error: {exc!r}")
    if outcome is TaskOutcome.PAUSED:
        delivery.give_back_attempt()
    if outcome in (TaskOutcome.ALREADY_COMMITTED, TaskOutcome.PAUSED):
        delivery.unqueue()
    return {"run": task.run, "shard": task.shard, "stage": spec.name, "outcome": outcome}


def publish_downstream(delivery: Delivery, spec: StageSpec, done: bool) -> None:
    """Hand a committed shard to the next stage unless it is done there or already queued."""
    ctx, task = delivery.ctx, delivery.task
    if done or spec.registry(ctx.redis, task.run).is_queued(task.shard):
        return
    publish_shard(app, ctx.redis, spec, task.run, task.shard)
