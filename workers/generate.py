"""The ``generate`` task: lease a shard, regenerate what is missing, write parts, commit, hand off.

Run a worker with ``dflash-pipeline worker generate`` (one per GPU). A shard can be delivered
any number of times: finished parts are never regenerated and the commit is written once.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import closing
from typing import Any

import redis
from celery import Task

from common import keys
from common.celery_app import (
    QUEUE_HIDDEN,
    QUEUE_TRAIN,
    TASK_GENERATE,
    TASK_HIDDEN,
    TASK_TRAIN,
    app,
)
from common.errors import (
    ConfigError,
    DflashError,
    LeaseBusy,
    NotFound,
    RunPaused,
    ShuttingDown,
)
from common.lease import Lease
from common.models import template_sha
from common.monitor import RunMonitor
from common.records import RunConfig, ShardTask, TaskOutcome, decode_jsonl_zst, dumps
from workers import metrics
from workers.context import WorkerContext, get_context
from workers.generation import Job, ShardCounters, regenerate
from workers.parts import PartBuffer, ShardParts
from workers.retrying import attempts_so_far, lease_wait, retry_later

log = logging.getLogger(__name__)

RETRYABLE = (DflashError, redis.RedisError, OSError)
_HANDOFF_RETRY = {"max_retries": 60, "interval_start": 0.5, "interval_step": 1, "interval_max": 5}


@app.task(name=TASK_GENERATE, bind=True, max_retries=None)
def generate_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point; retries, lease waits and parking live here, the work in process_shard."""
    task = ShardTask.from_json(payload)
    ctx = get_context()
    worker = self.request.hostname or "worker"
    try:
        outcome = process_shard(ctx, task, worker)
    except ShuttingDown as stop:
        # A stop is not the shard's fault: give the attempt back and let another worker go on.
        log.info("run %s shard %d: %s; requeued", task.run, task.shard, stop)
        _give_back_attempt(ctx, task)
        retry_later(self, 1, task)
    except RunPaused as paused:
        # Acked, not retried: `resume --accept-gates` queues the shard again.
        log.warning("run %s shard %d: %s; stopped", task.run, task.shard, paused)
        _give_back_attempt(ctx, task)
        outcome = TaskOutcome.PAUSED
    except LeaseBusy as busy:
        log.info("run %s shard %d: %s; retrying later", task.run, task.shard, busy)
        retry_later(self, lease_wait(ctx.settings.lease_ttl), task)
    except ConfigError as exc:
        outcome = park(ctx, task, str(exc))
    except RETRYABLE as exc:
        attempts = attempts_so_far(ctx.redis, keys.redis_attempts(task.run),
                                   keys.shard_name(task.shard))
        if attempts >= ctx.settings.max_deliveries:
            outcome = park(ctx, task, f"failed {attempts} times, last: {exc!r}")
        else:
            delay = min(ctx.settings.retry_backoff_max, 2.0**attempts)
            log.warning("run %s shard %d: attempt %d failed (%r); retry in %.0fs",
                        task.run, task.shard, attempts, exc, delay)
            retry_later(self, delay, task)
    except Exception as exc:  # a bug does not fix itself by retrying: park the shard
        log.exception("run %s shard %d: unexpected error", task.run, task.shard)
        outcome = park(ctx, task, f"unexpected error: {exc!r}")
    return {"run": task.run, "shard": task.shard, "outcome": outcome}


def process_shard(ctx: WorkerContext, task: ShardTask, worker: str) -> TaskOutcome:
    """The named steps of one delivery; safe to run again at any point."""
    commit_key = keys.generated_commit(task.run, task.shard)
    if ctx.storage.exists(commit_key):
        return TaskOutcome.ALREADY_COMMITTED
    config = load_run_config(ctx, task.run)
    monitor = RunMonitor(ctx.redis, ctx.storage, task.run, config.gates)
    monitor.ensure_ready()
    if monitor.paused():
        ctx.redis.hdel(keys.redis_queued(task.run), keys.shard_name(task.shard))
        log.info("run %s shard %d: run paused by its quality gates; not started", task.run,
                 task.shard)
        return TaskOutcome.PAUSED
    owner = f"{worker}:{uuid.uuid4().hex[:8]}"
    with Lease(ctx.redis, keys.redis_lease(task.run, task.shard), owner, ctx.settings.lease_ttl) \
            as lease:
        ctx.redis.hdel(keys.redis_queued(task.run), keys.shard_name(task.shard))
        attempts = ctx.redis.hincrby(keys.redis_attempts(task.run), keys.shard_name(task.shard))
        if attempts > ctx.settings.max_deliveries:
            return park(ctx, task, f"started {attempts - 1} times without committing "
                                   "(worker killed or lost each time)")
        if ctx.storage.exists(commit_key):
            return TaskOutcome.ALREADY_COMMITTED
        check_template(ctx, config)
        rows = load_input_shard(ctx, task)
        parts = ShardParts(ctx.storage, task)
        parts.refresh()
        done = parts.done_ids
        todo = [row for row in rows if row["id"] not in done]
        log.info("run %s shard %d: %d samples, %d already in %d parts, generating %d",
                 task.run, task.shard, len(rows), len(rows) - len(todo), len(parts.known),
                 len(todo))
        progress = Progress(ctx, task, worker, monitor)
        buffer = PartBuffer(parts, ctx.settings.part_samples, ctx.settings.part_seconds,
                            before_write=monitor.claim_answers, on_write=progress.part_written)
        job = Job(ctx.engine, config.sampling, config.gates, task.shard, progress.counters,
                  ctx.tokens)
        samples = regenerate(ctx.loop, job, todo)
        with closing(samples):
            for sample in samples:
                lease.check()
                buffer.add(sample)
                if ctx.stopping.is_set():
                    buffer.flush()
                    raise ShuttingDown(f"worker stopping; {len(parts.done_ids)} samples kept")
                if progress.pause:
                    raise RunPaused(f"run paused by its quality gates: {progress.pause['reason']}")
        buffer.flush()
        progress.flush_requests()
        commit = parts.commit([row["id"] for row in rows], worker)
        log.info("run %s shard %d: committed %d samples", task.run, task.shard, commit.samples)
        metrics.COMMITS.labels(task.run).inc()
        hand_off(ctx, config, task)
        forget_progress(ctx, task)
    return TaskOutcome.COMMITTED


def load_run_config(ctx: WorkerContext, run: str) -> RunConfig:
    try:
        return RunConfig.from_json(json.loads(ctx.storage.get(keys.run_config(run))))
    except NotFound as exc:
        raise DflashError(f"run {run!r} has no run.json in {ctx.storage.root}") from exc


def check_template(ctx: WorkerContext, config: RunConfig) -> None:
    """Refuse to generate with a chat template other than the one frozen in run.json."""
    mine = template_sha(getattr(ctx.engine.tokenizer, "chat_template", None))
    if config.chat_template_sha and mine != config.chat_template_sha:
        raise ConfigError(f"run {config.run!r} was enqueued with chat template "
                          f"{config.chat_template_sha}, this worker's model has {mine}")


def load_input_shard(ctx: WorkerContext, task: ShardTask) -> list[dict[str, Any]]:
    return decode_jsonl_zst(ctx.storage.get(keys.input_shard(task.run, task.shard)))


def hand_off(ctx: WorkerContext, config: RunConfig, task: ShardTask) -> None:
    """Queue the committed shard downstream: hidden states (offline) or training (online)."""
    stage, name, queue = ((QUEUE_TRAIN, TASK_TRAIN, QUEUE_TRAIN) if config.mode == "online"
                          else (QUEUE_HIDDEN, TASK_HIDDEN, QUEUE_HIDDEN))
    ctx.redis.hset(keys.redis_stage(task.run, stage, "queued"), keys.shard_name(task.shard), 1)
    app.send_task(name, args=[task.to_json()], queue=queue, retry=True,
                  retry_policy=_HANDOFF_RETRY)


def park(ctx: WorkerContext, task: ShardTask, reason: str) -> TaskOutcome:
    """Stop redelivering a shard that keeps failing; status shows it with its reason."""
    log.error("run %s shard %d: parked: %s", task.run, task.shard, reason)
    stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
    record = {"run": task.run, "shard": task.shard, "reason": reason, "at": time.time()}
    ctx.storage.put_once(keys.failed_shard(task.run, task.shard, stamp), dumps(record))
    ctx.redis.hset(keys.redis_parked(task.run), keys.shard_name(task.shard), reason)
    return TaskOutcome.PARKED


def _give_back_attempt(ctx: WorkerContext, task: ShardTask) -> None:
    try:
        ctx.redis.hincrby(keys.redis_attempts(task.run), keys.shard_name(task.shard), -1)
    except redis.RedisError as err:
        log.warning("run %s shard %d: attempt not given back: %s", task.run, task.shard, err)


class Progress:
    """Advisory counters for status (tokens/s, ETA, requests); losing them loses no data."""

    def __init__(self, ctx: WorkerContext, task: ShardTask, worker: str,
                 monitor: RunMonitor) -> None:
        self.ctx, self.task, self.worker, self.monitor = ctx, task, worker, monitor
        self.counters = ShardCounters()
        self.reported_requests = 0
        self.pause: dict[str, Any] | None = None

    def part_written(self, accepted: list[dict[str, Any]],
                     rejected: list[dict[str, Any]]) -> None:
        """Count a written part for status and the run monitor (which may pause the run)."""
        self.pause = self.monitor.record(accepted, rejected)
        metrics.REJECTED.labels(self.task.run).inc(len(rejected))
        samples = accepted + rejected
        task, run = self.task, self.task.run
        tokens = sum(s["usage"]["completion_tokens"] for s in samples)
        try:
            pipe = self.ctx.redis.pipeline()
            pipe.hincrby(keys.redis_partial(run), keys.shard_name(task.shard), len(samples))
            pipe.lpush(keys.redis_rate(run), f"{time.time():.3f} {tokens} {len(samples)}")
            pipe.ltrim(keys.redis_rate(run), 0, 999)
            pipe.execute()
        except redis.RedisError as err:
            log.warning("run %s shard %d: progress not recorded: %s", run, task.shard, err)
        metrics.SAMPLES.labels(run).inc(len(samples))
        metrics.TOKENS.labels(run).inc(tokens)
        metrics.PARTS.labels(run).inc()
        self.flush_requests()

    def flush_requests(self) -> None:
        sent = self.counters.requests
        metrics.REQUESTS.labels(self.task.run).inc(sent - self.reported_requests)
        try:
            self.ctx.redis.hincrby(keys.redis_requests(self.task.run), self.worker,
                                   sent - self.reported_requests)
            self.reported_requests = sent
        except redis.RedisError as err:
            log.warning("run %s shard %d: request count not recorded: %s", self.task.run,
                        self.task.shard, err)


def forget_progress(ctx: WorkerContext, task: ShardTask) -> None:
    try:
        ctx.redis.hdel(keys.redis_partial(task.run), keys.shard_name(task.shard))
        ctx.redis.hdel(keys.redis_attempts(task.run), keys.shard_name(task.shard))
    except redis.RedisError as err:
        log.warning("run %s shard %d: progress not cleared: %s", task.run, task.shard, err)
