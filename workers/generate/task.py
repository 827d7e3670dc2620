"""The ``generate`` task: lease a shard, regenerate what is missing, write parts, commit.

Run a worker with ``dflash-pipeline worker generate`` (one per GPU). A shard can be delivered
any number of times: finished parts are never regenerated and the commit is written once. The
skeleton hands the committed shard off (:func:`hand_off`), on a redelivery too.
"""

from __future__ import annotations

import logging
from contextlib import closing
from typing import Any

import redis
from celery import Task

from common import keys
from common.choices import Mode, RowKind, TaskOutcome
from common.engine.models import template_sha
from common.errors import ConfigError, RunPaused, ShuttingDown
from common.queue.celery_app import TASK_GENERATE, app
from common.queue.run_records import RunRecords
from common.reads import limits_of, read_rows
from common.row_caps import row_caps
from common.runs.records import RunConfig, ShardTask
from common.runs.schemas import INPUT_ROW, PauseRecord
from common.runs.store import RunStore
from workers.context import WorkerContext
from workers.generate import metrics, speculative
from workers.generate.context import GenerateContext, get_generate_context
from workers.generate.engines.base import Engine
from workers.generate.monitor import RunMonitor
from workers.generate.parts import PartBuffer, ShardParts
from workers.generate.regeneration import Job, ShardCounters, regenerate
from workers.lease import Lease
from workers.stage import GENERATE, HIDDEN, TRAIN, Delivery, publish_downstream, run_delivery

log = logging.getLogger(__name__)


@app.task(name=TASK_GENERATE, bind=True, max_retries=None)
def generate_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point: the shard-stage skeleton around :func:`process_shard`."""
    return run_delivery(self, GENERATE, payload, process_shard, hand_off)


def process_shard(delivery: Delivery) -> TaskOutcome:
    """The named steps of one delivery; safe to run again at any point."""
    ctx, task, worker = delivery.ctx, delivery.task, delivery.worker
    gen = get_generate_context()
    commit_key = keys.generated_commit(task.run, task.shard)
    if ctx.storage.exists(commit_key):
        return TaskOutcome.ALREADY_COMMITTED
    config = RunStore(ctx.storage, task.run).config()
    monitor = RunMonitor(ctx.redis, ctx.storage, task.run, config.gates)
    monitor.ensure_ready()
    if monitor.paused():
        delivery.unqueue()
        log.info("run %s shard %d: run paused by its quality gates; not started", task.run,
                 task.shard)
        return TaskOutcome.PAUSED
    with delivery.claim() as lease:
        if ctx.storage.exists(commit_key):
            return TaskOutcome.ALREADY_COMMITTED
        choice = gen.choice_for(config, worker)
        with gen.serving(choice) as engine:
            generate_rows(delivery, lease, gen, engine, config, monitor)
    return TaskOutcome.COMMITTED


def generate_rows(delivery: Delivery, lease: Lease, gen: GenerateContext, engine: Engine,
                  config: RunConfig, monitor: RunMonitor) -> None:
    """Generate the shard's missing rows on ``engine``, write their parts and commit."""
    ctx, task, worker = delivery.ctx, delivery.task, delivery.worker
    check_template(engine, config)
    speculative.check_lossless(engine, config.sampling, task.run)
    rows = load_input_shard(ctx, task, config)
    parts = ShardParts(ctx.storage, task,
                       cap=row_caps(RowKind.SAMPLES, config, limits_of(ctx.storage)))
    parts.refresh()
    done = parts.done_ids
    todo = [row for row in rows if row["id"] not in done]
    log.info("run %s shard %d: %d samples, %d already in %d parts, generating %d",
             task.run, task.shard, len(rows), len(rows) - len(todo), len(parts.known), len(todo))
    progress = Progress(ctx, task, worker, monitor, engine)
    generate = ctx.settings.generate
    buffer = PartBuffer(parts, generate.part_samples, generate.part_seconds,
                        before_write=monitor.claim_answers, on_write=progress.part_written,
                        worker=worker)
    job = Job(engine, config, task.shard, progress.counters, gen.tokens)
    samples = regenerate(gen.loop, job, todo)
    with closing(samples):
        for sample in samples:
            lease.check()
            buffer.add(sample)
            gen.produced(task.run, engine, int(sample["usage"]["completion_tokens"]))
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
    forget_progress(ctx, task)


def check_template(engine: Engine, config: RunConfig) -> None:
    """Refuse to generate with a chat template other than the one frozen in run.json."""
    mine = template_sha(getattr(engine.tokenizer, "chat_template", None))
    if config.chat_template_sha and mine != config.chat_template_sha:
        raise ConfigError(f"run {config.run!r} was enqueued with chat template "
                          f"{config.chat_template_sha}, this worker's model has {mine}")


def load_input_shard(ctx: WorkerContext, task: ShardTask,
                     config: RunConfig | None = None) -> list[dict[str, Any]]:
    # Bounded (by what a shard of the run holds) and typed: an input shard that is not one
    # parks this shard, naming it.
    cap = row_caps(RowKind.INPUT, config, limits_of(ctx.storage))
    return [dict(row) for row in read_rows(ctx.storage, keys.input_shard(task.run, task.shard),
                                            INPUT_ROW, cap)]


def hand_off(delivery: Delivery) -> None:
    """Queue the committed shard downstream: hidden states (offline) or training (online)."""
    ctx, task = delivery.ctx, delivery.task
    config = RunStore(ctx.storage, task.run).config()
    if config.mode is Mode.ONLINE:  # the trainer skips a shard its ledger has already
        publish_downstream(delivery, TRAIN, done=False)
    else:
        publish_downstream(delivery, HIDDEN,
                           done=ctx.storage.exists(keys.hidden_commit(task.run, task.shard)))


class Progress:
    """Advisory counters for status (tokens/s, ETA, requests); losing them loses no data."""

    def __init__(self, ctx: WorkerContext, task: ShardTask, worker: str,
                 monitor: RunMonitor, engine: Engine) -> None:
        self.ctx, self.task, self.worker, self.monitor = ctx, task, worker, monitor
        self.engine = engine   # its speculative algorithm, once known, labels the figures
        self.counters = ShardCounters()
        self.reported_requests = 0
        self.pause: PauseRecord | None = None

    def part_written(self, accepted: list[dict[str, Any]],
                     rejected: list[dict[str, Any]]) -> None:
        """Count a written part for status and the run monitor (which may pause the run)."""
        self.pause = self.monitor.record(accepted, rejected)
        metrics.REJECTED.labels(self.task.run).inc(len(rejected))
        samples = accepted + rejected
        task, run = self.task, self.task.run
        tokens = sum(s["usage"]["completion_tokens"] for s in samples)
        try:
            RunRecords(self.ctx.redis, run).record_part(task.shard, len(samples), tokens)
        except redis.RedisError as err:
            log.warning("run %s shard %d: progress not recorded: %s", run, task.shard, err)
        metrics.SAMPLES.labels(run).inc(len(samples))
        metrics.TOKENS.labels(run).inc(tokens)
        metrics.PARTS.labels(run).inc()
        speculative.record(self.ctx.redis, run, self.worker,
                           self.engine.algorithm, samples)
        self.flush_requests()

    def flush_requests(self) -> None:
        sent = self.counters.requests
        metrics.REQUESTS.labels(self.task.run).inc(sent - self.reported_requests)
        try:
            RunRecords(self.ctx.redis, self.task.run).count_requests(
                self.worker, sent - self.reported_requests)
            self.reported_requests = sent
        except redis.RedisError as err:
            log.warning("run %s shard %d: request count not recorded: %s", self.task.run,
                        self.task.shard, err)


def forget_progress(ctx: WorkerContext, task: ShardTask) -> None:
    try:
        RunRecords(ctx.redis, task.run).forget_partial(task.shard)
    except redis.RedisError as err:
        log.warning("run %s shard %d: progress not cleared: %s", task.run, task.shard, err)
