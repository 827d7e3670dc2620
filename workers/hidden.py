"""The ``hidden`` task: target hidden states of a committed shard, stored as safetensors parts.

Run a worker with ``dflash-pipeline worker hidden [--gpu N]``: it loads the target once and
takes shards from queue ``hidden`` (queued by the generate worker after each commit, and by
``resume``). Only samples that passed the quality gates are read (the commit's ``sample_ids``);
each assistant turn is one training row. Parts are put-once and the shard's ``_COMMIT.json``
names the canonical ones, so a killed worker's partial parts are never read twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import redis
from celery import Task

from common import keys
from common.celery_app import QUEUE_TRAIN, TASK_HIDDEN, TASK_TRAIN, app
from common.errors import (
    ConfigError,
    DflashError,
    HiddenStateError,
    LeaseBusy,
    NotFound,
    ShuttingDown,
)
from common.hidden_store import HiddenShardWriter, write_hidden_commit
from common.lease import Lease
from common.records import RunConfig, ShardCommit, ShardTask, TaskOutcome, decode_jsonl_zst, dumps
from common.trainrows import TrainingRow, training_rows
from workers.context import WorkerContext, get_context
from workers.hidden_states import ExtractorConfig, HiddenExtractor, length_batches
from workers.retrying import attempts_so_far, lease_wait, retry_later

log = logging.getLogger(__name__)

STAGE = "hidden"
RETRYABLE = (DflashError, redis.RedisError, OSError)
_extractors: dict[ExtractorConfig, HiddenExtractor] = {}
_extractor_lock = threading.Lock()


@app.task(name=TASK_HIDDEN, bind=True, max_retries=None)
def hidden_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point: retries and parking here, the work in :func:`process_hidden`."""
    task = ShardTask.from_json(payload)
    ctx = get_context()
    worker = self.request.hostname or "hidden"
    try:
        outcome = process_hidden(ctx, task, worker)
    except ShuttingDown as stop:
        log.info("run %s shard %d: %s; requeued", task.run, task.shard, stop)
        retry_later(self, 1, task)
    except LeaseBusy as busy:
        log.info("run %s shard %d: %s; retrying later", task.run, task.shard, busy)
        retry_later(self, lease_wait(ctx.settings.lease_ttl), task)
    except (ConfigError, HiddenStateError) as exc:
        outcome = park_stage(ctx, task, STAGE, str(exc))
    except RETRYABLE as exc:
        attempts = attempts_so_far(ctx.redis, keys.redis_stage(task.run, STAGE, "attempts"),
                                   keys.shard_name(task.shard))
        if attempts >= ctx.settings.max_deliveries:
            outcome = park_stage(ctx, task, STAGE, f"failed {attempts} times, last: {exc!r}")
        else:
            delay = min(ctx.settings.retry_backoff_max, 2.0**attempts)
            log.warning("run %s shard %d: hidden attempt %d failed (%r); retry in %.0fs",
                        task.run, task.shard, attempts, exc, delay)
            retry_later(self, delay, task)
    return {"run": task.run, "shard": task.shard, "outcome": outcome}


def process_hidden(ctx: WorkerContext, task: ShardTask, worker: str) -> TaskOutcome:
    """The named steps of one delivery; safe to run again at any point."""
    storage, name = ctx.storage, keys.shard_name(task.shard)
    if storage.exists(keys.hidden_commit(task.run, task.shard)):
        return TaskOutcome.ALREADY_COMMITTED
    owner = f"{worker}:{uuid.uuid4().hex[:8]}"
    lease_key = keys.redis_stage(task.run, STAGE, f"lease:{name}")
    with Lease(ctx.redis, lease_key, owner, ctx.settings.lease_ttl) as lease:
        ctx.redis.hdel(keys.redis_stage(task.run, STAGE, "queued"), name)
        ctx.redis.hincrby(keys.redis_stage(task.run, STAGE, "attempts"), name)
        if storage.exists(keys.hidden_commit(task.run, task.shard)):
            return TaskOutcome.ALREADY_COMMITTED
        config = load_config(ctx, task.run)
        rows = load_rows(ctx, task)
        extractor = get_extractor(ctx, config)
        writer = HiddenShardWriter(storage, task.run, task.shard, extractor.meta,
                                   part_bytes=ctx.settings.hidden_part_bytes)
        batches, padding = length_batches(rows, max_tokens=ctx.settings.hidden_batch_tokens)
        started = time.monotonic()
        for batch in batches:
            lease.check()
            if ctx.stopping.is_set():
                raise ShuttingDown("worker stopping; the shard starts over on redelivery")
            writer.add(extractor.extract(batch))
        index = write_hidden_commit(storage, task.run, task.shard, writer.finish(), worker)
        elapsed = max(time.monotonic() - started, 1e-9)
        log.info("run %s shard %d: hidden states of %d rows (%d tokens, %.0f tok/s, padding "
                 "%.1f%%) in %d parts", task.run, task.shard, index.records, index.tokens,
                 index.tokens / elapsed, 100 * padding.waste, len(index.parts))
        ctx.redis.hdel(keys.redis_stage(task.run, STAGE, "attempts"), name)
        if config.layout == "dflash":
            # A drafter trainer, if one runs for this run, learns from the stored features.
            ctx.redis.hset(keys.redis_stage(task.run, "train", "queued"), name, 1)
            app.send_task(TASK_TRAIN, args=[task.to_json()], queue=QUEUE_TRAIN)
    return TaskOutcome.COMMITTED


def load_config(ctx: WorkerContext, run: str) -> RunConfig:
    try:
        return RunConfig.from_json(json.loads(ctx.storage.get(keys.run_config(run))))
    except NotFound as exc:
        raise ConfigError(f"run {run!r} has no run.json in {ctx.storage.root}") from exc


def load_rows(ctx: WorkerContext, task: ShardTask) -> list[TrainingRow]:
    """Training rows of the shard's accepted samples, read through its generate commit."""
    try:
        commit = ShardCommit.from_json(json.loads(
            ctx.storage.get(keys.generated_commit(task.run, task.shard))))
    except NotFound as exc:
        raise ConfigError(f"shard {task.shard} of run {task.run} is not committed yet") from exc
    return read_rows(ctx.storage, commit)


def read_rows(storage: Any, commit: ShardCommit) -> list[TrainingRow]:
    """Every accepted sample's rows once, from the part the commit names for it."""
    wanted = set(commit.sample_ids)
    rows: list[TrainingRow] = []
    for part in sorted({commit.part_of[i] for i in wanted}):
        for sample in decode_jsonl_zst(storage.get(part)):
            if sample["id"] in wanted and commit.part_of[sample["id"]] == part:
                rows.extend(training_rows(sample))
    return rows


def get_extractor(ctx: WorkerContext, config: RunConfig) -> HiddenExtractor:
    """The target, loaded once per process (per run layout) and shared by its shards."""
    from dataclasses import replace

    from common.models import resolve_model_path

    path = resolve_model_path(replace(ctx.settings, model=config.model))
    wanted = ExtractorConfig(str(path), layout=config.layout, k=config.target_layers,
                             device=ctx.settings.hidden_device)
    with _extractor_lock:
        if wanted not in _extractors:
            _extractors[wanted] = HiddenExtractor(wanted)
        return _extractors[wanted]


def park_stage(ctx: WorkerContext, task: ShardTask, stage: str, reason: str) -> TaskOutcome:
    """Stop redelivering a shard that keeps failing in ``stage``; resume tries it again."""
    log.error("run %s shard %d: %s stage parked: %s", task.run, task.shard, stage, reason)
    stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
    record = {"run": task.run, "shard": task.shard, "stage": stage, "reason": reason,
              "at": time.time()}
    ctx.storage.put_once(keys.failed_shard(task.run, task.shard, stamp, stage), dumps(record))
    ctx.redis.hset(keys.redis_stage(task.run, stage, "parked"), keys.shard_name(task.shard),
                   reason)
    return TaskOutcome.PARKED
