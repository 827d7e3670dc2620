"""The ``train`` task: DFlash drafter training on committed shards.

Run one worker per run with ``dflash-pipeline worker train [--gpu N]``: it holds the frozen
target, the drafter and its optimizer, takes shards from queue ``train`` (routed there after
each commit when the run's mode is ``online``), computes the target's features on the fly and
trains; nothing is stored but checkpoints. In ``offline`` runs the same code trains from the
features the hidden-state stage stored (the hidden worker queues each shard it commits).
Every ``DFLASH_TRAIN_CHECKPOINT_STEPS`` steps it checkpoints to
``runs/<run>/drafter/`` with a ledger of consumed shards and rows; a restarted worker resumes
from the newest checkpoint, skips shards already in the ledger and the rows of a shard already
trained, so every shard is trained once per epoch. After a crash, ``resume --run RUN`` queues
the shards that finished after the last checkpoint again.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from celery import Task

from common import keys
from common.choices import Mode, TaskOutcome
from common.errors import ConfigError, NothingToTrain, NotReady, ShuttingDown
from common.faults import inject
from common.json_parse import finite_list
from common.queue.celery_app import TASK_TRAIN, app
from common.runs.checkpoints import OUT_OF_MEMORY, save_checkpoint
from common.runs.epochs import row_order
from common.runs.records import RunConfig, ShardTask
from common.runs.store import RunStore
from common.runs.trainrows import TrainingRow
from workers.context import WorkerContext
from workers.lease import Lease
from workers.stage import TRAIN, Delivery, run_delivery
from workers.train.drafter.features import TrainRow, plain_row
from workers.train.epochs import (
    end_epoch,
    epoch_complete,
    note_shard,
    queue_epoch,
    revise_schedule,
    schedule_spent,
)
from workers.train.memory import fits_row
from workers.train.process_group import current_group, group_fields
from workers.train.session import Session, get_session
from workers.train.tensorboard import log_step

log = logging.getLogger(__name__)

@app.task(name=TASK_TRAIN, bind=True, max_retries=None)
def train_shard(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point: the shard-stage skeleton around :func:`process_train`."""
    return run_delivery(self, TRAIN, payload, process_train)


def process_train(delivery: Delivery) -> TaskOutcome:
    """Train on a shard's rows that the ledger has not seen in its epoch; checkpoint on the way;
    at an epoch's end, measure tau and start the next epoch (or finish)."""
    ctx, task = delivery.ctx, delivery.task
    # One trainer per run: the run-wide lease keeps a second worker from forking the drafter.
    with delivery.claim() as lease:
        store = RunStore(ctx.storage, task.run)
        config = store.config()
        if not ctx.storage.exists(keys.inputs_manifest(task.run)):
            # The held-out split is frozen with the manifest, when enqueue has read the input.
            raise NotReady(f"run {task.run}: enqueue has not finished reading the input")
        session = get_session(ctx, config)
        ledger = session.ledger
        if ledger.finished or task.shard in ledger.done:
            log.info("run %s shard %d: %s; skipped", task.run, task.shard,
                     f"training finished ({ledger.finished})" if ledger.finished else
                     f"already trained in epoch {ledger.epoch + 1}")
            return TaskOutcome.ALREADY_COMMITTED
        rows = training_rows(ctx, store, session, task, online=config.mode is Mode.ONLINE)
        note_shard(ledger, task.shard, len(rows), ctx.settings.train.rows_per_step)
        revise_schedule(ctx, session, store, config, f"shard {task.shard} read")
        train_rows(ctx, lease, session, config, task, rows)
        finish_shard(ctx, session, store, config, task.shard)
    return TaskOutcome.COMMITTED


def train_rows(ctx: WorkerContext, lease: Lease, session: Session, config: RunConfig,
               task: ShardTask, rows: list[TrainRow]) -> None:
    """The shard's steps from the first row its epoch has not trained; checkpoints between."""
    size = ctx.settings.train.rows_per_step
    session.trainer.oom.restore()   # a budget halved by an out-of-memory step lasts one shard
    for first in range(session.ledger.rows_done(task.shard), len(rows), size):
        lease.check()
        if ctx.stopping.is_set():
            raise ShuttingDown("worker stopping; the shard resumes from the last checkpoint")
        if schedule_spent(ctx, session, config, task.shard, len(rows) - first):
            return
        estimate = train_step(ctx, session, config, rows[first:first + size], task)
        session.ledger.partial[str(task.shard)] = first + size
        if session.steps - session.last_checkpoint >= ctx.settings.train.checkpoint_steps:
            checkpoint(ctx, session, estimate)
        elif session.evaluator is not None and session.evaluator.due(session.steps):
            evaluate_drafter(ctx, session, estimate)


def finish_shard(ctx: WorkerContext, session: Session, store: RunStore, config: RunConfig,
                 shard: int) -> None:
    """The shard is trained in this epoch; the epoch may end here. Checkpointed before the task
    is acked, so a shard reported done is always in a checkpoint's ledger."""
    ledger = session.ledger
    if not ledger.finished:
        ledger.partial.pop(str(shard), None)
        ledger.done.append(shard)
    shards = None if ledger.finished else epoch_complete(store, config, ledger)
    next_epoch = False
    if shards is not None:
        tau = evaluate_drafter(ctx, session, None).get("tau")
        next_epoch = end_epoch(ctx, session, config, shards, tau)
    checkpoint(ctx, session)   # put-once: the ledger's new epoch is durable before its queueing
    record_metrics(ctx, config.run, progress_fields(session, config))
    if next_epoch and shards is not None:
        inject("train.epoch_end")   # a crash here: the reconciler queues the epoch from storage
        queue_epoch(ctx, config, ledger, shards)


def progress_fields(session: Session, config: RunConfig) -> dict[str, Any]:
    """The metrics record's epoch, schedule and finish fields (``status`` shows them)."""
    ledger = session.ledger
    aside = ledger.set_aside_counts()
    return {"step": session.steps, "epoch": min(ledger.epoch + 1, config.epochs),
            "epochs": config.epochs,
            "total_steps": session.trainer.schedule.total,
            "tau_by_epoch": json.dumps(ledger.tau_by_epoch), "finished": str(ledger.finished),
            "oom_retries": ledger.oom_retries,
            **{f"rows_{reason}": n for reason, n in aside.items()},
            "memory_plan": session.plan.verdict() if session.plan else "",
            **session.pace.fields()}


def training_rows(ctx: WorkerContext, store: RunStore, session: Session, task: ShardTask,
                  online: bool) -> list[TrainRow]:
    """The shard's rows in its epoch's order: the held-out split left out, rows past the run's
    --max-train-tokens cut, and rows set aside that are too short to train or that no
    micro-batch fits (each counted in the ledger, so status shows them)."""
    every = store.training_rows(task.shard) if online else stored_rows(ctx, session, task)
    rows = [r for r in every if plain_row(r).sample_id not in session.heldout]
    held = {plain_row(r).sample_id for r in every} & session.heldout
    limit = session.config_max_tokens
    cut = [cut_row(r, limit) if limit and len(plain_row(r).input_ids) > limit else r
           for r in rows]
    shortest = session.trainer.min_supervised
    kept = [r for r in cut if plain_row(r).supervised_tokens >= shortest]
    fitting = [r for r in kept if fits_row(session.plan, len(plain_row(r).input_ids),
                                           plain_row(r).supervised_tokens)]
    counts = {"too_short": len(cut) - len(kept), "too_long": len(kept) - len(fitting),
              "cut": sum(a is not b for a, b in zip(rows, cut, strict=True))}
    # Rows that ran out of memory alone in this shard's epoch so far (a resumed shard keeps them).
    before = session.ledger.set_aside.get(str(task.shard), {})
    if session.ledger.rows_done(task.shard) and before.get(OUT_OF_MEMORY):
        counts[OUT_OF_MEMORY] = before[OUT_OF_MEMORY]
    session.ledger.set_aside[str(task.shard)] = counts
    log.info("run %s shard %d: %d rows to train, %d held-out samples left out, %d rows with "
             "< %d supervised tokens and %d no micro-batch fits set aside, %d cut to %s "
             "tokens; epoch %d", task.run, task.shard, len(fitting), len(held),
             counts["too_short"], shortest, counts["too_long"], counts["cut"], limit or "-",
             session.ledger.epoch + 1)
    return row_order(task.run, session.ledger.epoch, task.shard, fitting)


def cut_row(row: TrainRow, limit: int) -> TrainRow:
    """The row's first ``limit`` tokens (and their stored features)."""
    from workers.train.drafter.features import FeaturedRow

    plain = plain_row(row)
    first = TrainingRow(plain.sample_id, plain.turn, plain.input_ids[:limit],
                        plain.loss_mask[:limit])
    return FeaturedRow(first, row.features[:limit]) if isinstance(row, FeaturedRow) else first


def stored_rows(ctx: WorkerContext, session: Session, task: ShardTask) -> list[TrainRow]:
    """Offline runs: the rows with the features the hidden-state stage stored (same order)."""
    from common.hidden.store import iter_hidden_records, read_hidden_commit
    from workers.train.drafter.features import FeaturedRow

    index = read_hidden_commit(ctx.storage, task.run, task.shard)
    if index is None:
        raise NotReady(f"hidden states of shard {task.shard} are not committed yet")
    if list(index.layer_ids) != session.layer_ids:
        raise ConfigError(f"stored hidden states hold layers {index.layer_ids} ({index.layout}); "
                          f"the DFlash drafter trains on layers {session.layer_ids}")
    # Kept on the CPU in their stored dtype: each micro-batch moves its own to the device.
    return [FeaturedRow(TrainingRow(r["sample_id"], r["turn"], r["input_ids"].tolist(),
                                    r["loss_mask"].tolist()), r["hidden_states"])
            for r in iter_hidden_records(ctx.storage, task.run, [task.shard])]


def train_step(ctx: WorkerContext, session: Session, config: RunConfig, rows: list[TrainRow],
               task: ShardTask) -> float | None:
    """One optimizer step (target features on the fly unless stored); metrics to Redis and log.
    Returns the step's training estimate of the acceptance length (None: nothing trained)."""
    if current_group() is None:   # a group's ranks inject per micro-batch themselves
        inject("train.forward")
    try:
        metrics = session.trainer.step(rows)
    except NothingToTrain as skip:
        log.info("run %s shard %d: %s", task.run, task.shard, skip)
        return None
    finally:
        note_out_of_memory(session, task)
    log.info("run %s shard %d: %s", task.run, task.shard, metrics.summary())
    session.pace.add(rows, metrics.seconds)
    record = {"step": metrics.step, "loss": round(metrics.loss, 5),
              "slot1_accuracy": round(metrics.slot_accuracy[0], 4),
              "slot_accuracy": finite_list(metrics.slot_accuracy),
              "acceptance_length": round(metrics.acceptance_length, 3),
              "tokens_per_s": round(metrics.tokens_per_s, 1), "lr": metrics.lr,
              **progress_fields(session, config), "eta_s": round(session.eta_s(), 1),
              **group_fields(), "at": time.time()}
    record_metrics(ctx, task.run, record)
    return metrics.acceptance_length


def note_out_of_memory(session: Session, task: ShardTask) -> None:
    """The step's out-of-memory retries and the rows it set aside, into the ledger."""
    oom, ledger = session.trainer.oom, session.ledger
    if not oom.retries and not oom.set_aside:
        return
    ledger.oom_retries += oom.retries
    counts = ledger.set_aside.setdefault(str(task.shard), {})
    counts[OUT_OF_MEMORY] = counts.get(OUT_OF_MEMORY, 0) + oom.set_aside
    log.warning("run %s shard %d: step %d retried %d time(s) out of memory, %d row(s) set aside; "
                "micro-batches of %d tokens with activation checkpointing on for the rest of "
                "the shard", task.run, task.shard, session.steps, oom.retries, oom.set_aside,
                oom.current)
    oom.new_step()


def record_metrics(ctx: WorkerContext, run: str, record: dict[str, Any]) -> None:
    """The metrics row: TensorBoard (when on) and the Redis record that ``status`` reads."""
    log_step(ctx.settings.train.tensorboard_dir, run, record)
    try:
        TRAIN.registry(ctx.redis, run).record_metrics(record)
    except redis.RedisError as err:
        log.warning("run %s: training metrics not recorded: %s", run, err)


def checkpoint(ctx: WorkerContext, session: Session, estimate: float | None = None) -> None:
    """Save the trainer and ledger with the latest metrics, then measure the acceptance length:
    an evaluation that fails, or never returns, cannot cost the steps since the last one."""
    metrics: dict[str, Any] = dict(TRAIN.registry(ctx.redis, session.run).metrics())
    save_checkpoint(ctx.storage, session.run, session.steps, session.trainer.state_dict(),
                    session.ledger, metrics)
    session.last_checkpoint = session.steps
    if session.evaluator is not None and session.evaluator.last_step != session.steps:
        evaluate_drafter(ctx, session, estimate)


def evaluate_drafter(ctx: WorkerContext, session: Session,
                     estimate: float | None) -> dict[str, Any]:
    """The periodic eval; a failure is recorded (log, metrics row, ``status``), never raised.
    Returns the eval's fields (empty without an evaluator)."""
    if session.evaluator is None:
        return {}
    fields = session.evaluator.run_safely(session.trainer.eval_drafter(), session.steps,
                                          estimate)
    record_metrics(ctx, session.run, {"step": session.steps, **fields})
    return fields
