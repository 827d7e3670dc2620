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
from typing import Any

from celery import Task

from common import keys
from common.celery_app import TASK_HIDDEN, app
from common.errors import ConfigError, NotFound, NotReady, ShuttingDown
from common.faults import inject
from common.hidden_store import HiddenShardWriter, write_hidden_commit
from common.records import RunConfig, ShardCommit, ShardTask, TaskOutcome, decode_jsonl_zst
from common.trainrows import TrainingRow, training_rows
from workers.context import WorkerContext
from workers.hidden_states import ExtractorConfig, HiddenExtractor, length_batches
from workers.stage import HIDDEN, TRAIN, Delivery, run_delivery

log = logging.getLogger(__name__)

_extractors: dict[ExtractorConfig, HiddenExtractor] = {}
_extractor_lock = threading.Lock()


@app.task(name=TASK_HIDDEN, bind=True, max_retries=None)
def hidden_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point: the shard-stage skeleton around :func:`process_hidden`."""
    return run_delivery(self, HIDDEN, payload, process_hidden)


def process_hidden(delivery: Delivery) -> TaskOutcome:
    """The named steps of one delivery; safe to run again at any point."""
    ctx, task, worker = delivery.ctx, delivery.task, delivery.worker
    storage = ctx.storage
    if storage.exists(keys.hidden_commit(task.run, task.shard)):
        return TaskOutcome.ALREADY_COMMITTED
    with delivery.claim() as lease:
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
            inject("hidden.forward")
            writer.add(extractor.extract(batch))
        index = write_hidden_commit(storage, task.run, task.shard, writer.finish(), worker)
        elapsed = max(time.monotonic() - started, 1e-9)
        log.info("run %s shard %d: hidden states of %d rows (%d tokens, %.0f tok/s, padding "
                 "%.1f%%) in %d parts", task.run, task.shard, index.records, index.tokens,
                 index.tokens / elapsed, 100 * padding.waste, len(index.parts))
        if config.layout == "dflash":
            # A drafter trainer, if one runs for this run, learns from the stored features.
            ctx.redis.hset(TRAIN.keys(task.run).queued,
                           keys.shard_name(task.shard), 1)
            app.send_task(TRAIN.task_name, args=[task.to_json()], queue=TRAIN.queue)
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
        raise NotReady(f"shard {task.shard} of run {task.run} is not committed yet") from exc
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
