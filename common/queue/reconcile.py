"""The reconciler: queue every shard that storage says is due and Redis says nobody holds.

Level-triggered, like a Kubernetes controller: for each active run (``dflash:runs``) and each
stage, storage says what is done and what is due (a shard is due at ``generate`` once enqueued,
downstream once its upstream stage committed it), Redis says what is owned (a live lease, or a
``queued`` marker with a message behind it: :mod:`common.queue.dispatch`). Every due shard that is
not done, not parked and not owned is queued, once. A pass lists storage prefixes and reads
``run.json``, the manifest and the drafter's ledger, never a part. Workers run it every half
lease TTL, one at a time (the :func:`reconcile` lock); ``resume`` runs the same pass once.
Duplicate deliveries stay harmless: the lease keeps them apart and commits are put-once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from common.choices import Layout, Mode
from common.errors import DflashError
from common.queue import redis_keys
from common.queue.celery_app import GENERATE, HIDDEN, STAGES, TRAIN, StageSpec
from common.queue.dispatch import publish_shard, queued_in
from common.queue.shard_registry import StageView, Waiting, unwatch_run, watched_runs
from common.runs.epochs import shard_order
from common.runs.store import RunStore
from common.storage import Storage

log = logging.getLogger(__name__)

def waiting_messages(client: redis.Redis) -> Waiting:
    return {spec.queue: queued_in(client, spec.queue) for spec in STAGES}


def read_stage(client: redis.Redis, spec: StageSpec, run: str, lease_ttl: float,
               waiting: Waiting, now: float | None = None) -> StageView:
    """One stage's shards as its registry reads them (:meth:`ShardRegistry.view`)."""
    return spec.registry(client, run).view(lease_ttl, waiting.get(spec.queue),
                                           spec.one_per_run, now)


@dataclass
class RunPlan:
    """Per stage of one run: the shards due (upstream done, this stage not)."""

    run: str
    due: dict[str, set[int]] = field(default_factory=dict)
    upstream: dict[str, str] = field(default_factory=dict)
    order: dict[str, Callable[[Iterable[int]], list[int]]] = field(default_factory=dict)
    paused: bool = False

    def ordered(self, stage: str, shards: set[int]) -> list[int]:
        """``shards`` in the order the stage takes them (the train epoch's), else by number."""
        return self.order[stage](shards) if stage in self.order else sorted(shards)

    @property
    def finished(self) -> bool:
        return not self.paused and not any(self.due.values())


def plan_run(storage: Storage, client: redis.Redis, run: str) -> RunPlan | None:
    """What storage says is due in ``run``; None while enqueue has not finished (or no run)."""
    store = RunStore(storage, run)
    config, manifest = store.config_or_none(), store.manifest()
    if config is None or manifest is None:
        return None
    pipe = client.pipeline(transaction=False)
    redis_keys.read_pause(pipe, run)
    plan = RunPlan(run, paused=redis_keys.pause_in(run, *pipe.execute()) is not None)
    generated = store.committed("generate")
    if not plan.paused:  # a paused run generates nothing new; `resume --accept-gates` lifts it
        plan.due[GENERATE.name] = set(range(manifest.shards)) - generated
    if config.mode is Mode.ONLINE:
        _plan_training(plan, storage, run, generated, GENERATE.name)
        return plan
    hidden = store.committed("hidden")
    plan.due[HIDDEN.name] = generated - hidden
    plan.upstream[HIDDEN.name] = GENERATE.name
    if config.layout is Layout.DFLASH:  # offline training only once a trainer ran
        _plan_training(plan, storage, run, hidden, HIDDEN.name, started_only=True)
    return plan


def _plan_training(plan: RunPlan, storage: Storage, run: str, upstream: set[int],
                   stage: str, started_only: bool = False) -> None:
    """The train stage's due shards: not trained in the trainer's epoch, in its order."""
    from common.runs.checkpoints import train_due

    due = train_due(storage, run, upstream)
    if due is None and started_only:
        return
    plan.due[TRAIN.name], epoch = due if due is not None else (set(upstream), 0)
    plan.order[TRAIN.name] = functools.partial(shard_order, run, epoch)
    plan.upstream[TRAIN.name] = stage


@dataclass(frozen=True)
class Flags:
    """``resume``'s flags: ``force`` ignores queued markers, ``parked`` re-queues parked shards,
    ``leases`` False queues a leased shard too, as ``resume`` always did (its worker may be
    dead already; if not, the lease turns the duplicate away)."""

    force: bool = False
    parked: bool = False
    leases: bool = True
    dry_run: bool = False   # say what is due and unowned; queue nothing, write nothing


def reconcile_run(storage: Storage, app: Celery, client: redis.Redis, run: str,
                  lease_ttl: float, waiting: Waiting, flags: Flags = Flags(),
                  ) -> list[tuple[str, int]] | None:
    """Queue the due, unowned shards of one run; returns (stage, shard) queued, None if unplanned.

    A downstream shard whose upstream lease is live is left alone: its worker hands it off
    before it lets the lease go.
    """
    plan = plan_run(storage, client, run)
    if plan is None:
        return None
    now = time.time()
    views = {spec.name: read_stage(client, spec, run, lease_ttl, waiting, now) for spec in STAGES}
    sent = []
    for spec in STAGES:
        due, view = plan.due.get(spec.name, set()), views[spec.name]
        skip = (set(view.live) if flags.leases else set()) | (
            set() if flags.force else set(view.queued)) | (
            set() if flags.parked else set(view.parked))
        if spec.name in plan.upstream and flags.leases:
            skip |= views[plan.upstream[spec.name]].live
        for shard in plan.ordered(spec.name, due - skip):
            why = ("its worker was lost" if shard in view.running else
                   "its queued message is gone" if shard in view.stale else "it was never queued")
            sent.append((spec.name, shard))
            if flags.dry_run:
                continue
            log.warning("run %s shard %d (%s): due, not owned (%s); queued again", run, shard,
                        spec.name, why)
            # before the send: the worker that takes the message shows it running again
            spec.registry(client, run).forget_lost(shard)
            publish_shard(app, client, spec, run, shard, fresh=shard in view.parked)
        for shard in set() if flags.dry_run else view.stale - due:  # done meanwhile: the
            spec.registry(client, run).unqueue(shard)  # marker misleads
    if plan.finished and not flags.dry_run:
        unwatch_run(client, run)  # every stage done: nothing left to watch
    return sent


def reconcile(storage: Storage, app: Celery, client: redis.Redis, lease_ttl: float,
              runs: Iterable[str] | None = None, flags: Flags = Flags(),
              wait_s: float | None = None) -> dict[str, list[tuple[str, int]]] | None:
    """One pass over ``runs`` (default: every active run) under the reconciler lock.

    ``wait_s`` None: skip the pass if another process holds the lock (the periodic workers);
    else wait that long for it (``resume``). The lock lives one lease TTL and is renewed before
    each run, so a holder killed mid-pass delays the next pass by one TTL at most. Returns what
    each run queued, None if skipped.
    """
    lock = client.lock(redis_keys.redis_reconciler(), timeout=lease_ttl,
                       blocking=wait_s is not None, blocking_timeout=wait_s,
                       thread_local=False)
    if not lock.acquire():
        return None
    done: dict[str, list[tuple[str, int]]] = {}
    try:
        waiting = waiting_messages(client)
        members = watched_runs(client)
        chosen = sorted(members) if runs is None else list(runs)
        for run in chosen:
            lock.reacquire()  # LockError: the pass outlived its lock; another one took over
            try:
                sent = reconcile_run(storage, app, client, run, lease_ttl, waiting, flags)
            except (redis.RedisError, redis.exceptions.LockError, OperationalError):
                raise   # the pass's own trouble (kombu's publish wraps Redis's): the caller retries
            except Exception as err:  # noqa: BLE001 - one run never stops the others
                # One run's storage trouble, an object that does not read (someone wrote it by
                # hand), or a bug met on its data: logged with the run, and the pass goes on.
                log.warning("run %s: not reconciled this pass: %s: %s", run,
                            type(err).__name__, err, exc_info=not isinstance(err, DflashError))
                continue
            if sent is not None:
                done[run] = sent
    except redis.exceptions.LockError as err:
        log.warning("reconciler pass cut short: %s", err)
    finally:
        with contextlib.suppress(redis.exceptions.LockError):
            lock.release()
    return done
