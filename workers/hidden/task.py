"""The ``hidden`` task: target hidden states of a committed shard, stored as safetensors parts.

Run a worker with ``dflash-pipeline worker hidden [--gpu N]``: it loads the target once and
takes shards from queue ``hidden`` (queued by the generate worker after each commit, and by
``resume``). Only samples that passed the quality gates are read (the commit's ``sample_ids``);
each assistant turn is one training row. Parts are put-once and the shard's ``_COMMIT.json``
names the canonical ones, so a killed worker's partial parts are never read twice.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Task

from common import keys
from common.choices import Layout, TaskOutcome
from common.errors import ShuttingDown
from common.faults import inject
from common.hidden.store import write_hidden_commit
from common.hidden.writer import HiddenShardWriter
from common.queue.celery_app import TASK_HIDDEN, app
from common.runs.records import RunConfig
from common.runs.store import RunStore
from workers.batching import length_batches
from workers.context import WorkerContext
from workers.hidden.extraction import ExtractorConfig, HiddenExtractor
from workers.stage import HIDDEN, TRAIN, Delivery, publish_downstream, run_delivery

log = logging.getLogger(__name__)

_extractors: dict[ExtractorConfig, HiddenExtractor] = {}
_extractor_lock = threading.Lock()


@app.task(name=TASK_HIDDEN, bind=True, max_retries=None)
def hidden_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point: the shard-stage skeleton around :func:`process_hidden`."""
    return run_delivery(self, HIDDEN, payload, process_hidden, hand_off)


def process_hidden(delivery: Delivery) -> TaskOutcome:
    """The named steps of one delivery; safe to run again at any point."""
    ctx, task, worker = delivery.ctx, delivery.task, delivery.worker
    storage = ctx.storage
    if storage.exists(keys.hidden_commit(task.run, task.shard)):
        return TaskOutcome.ALREADY_COMMITTED
    with delivery.claim() as lease:
        if storage.exists(keys.hidden_commit(task.run, task.shard)):
            return TaskOutcome.ALREADY_COMMITTED
        store = RunStore(storage, task.run)
        config = store.config()
        rows = store.training_rows(task.shard)
        extractor = get_extractor(ctx, config)
        writer = HiddenShardWriter(storage, task.run, task.shard, extractor.meta,
                                   part_bytes=ctx.settings.hidden.part_bytes)
        batches, padding = length_batches(rows, max_tokens=ctx.settings.hidden.batch_tokens)
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
    return TaskOutcome.COMMITTED


def hand_off(delivery: Delivery) -> None:
    """A drafter trainer, if one runs for this run, learns from the stored features."""
    if RunStore(delivery.ctx.storage, delivery.task.run).config().layout is Layout.DFLASH:
        publish_downstream(delivery, TRAIN, done=False)


def get_extractor(ctx: WorkerContext, config: RunConfig) -> HiddenExtractor:
    """The target, loaded once per process (per run layout) and shared by its shards."""

    from common.engine.models import resolve_model_path

    path = resolve_model_path(ctx.settings.replace(model=config.model))
    frozen = tuple(config.target_layer_ids) if config.target_layer_ids else None
    wanted = ExtractorConfig(str(path), layout=config.layout, k=config.target_layers,
                             layer_ids=frozen if config.layout is Layout.DFLASH else None,
                             device=ctx.settings.hidden.device)
    with _extractor_lock:
        if wanted not in _extractors:
            _extractors[wanted] = HiddenExtractor(wanted)
        return _extractors[wanted]
