"""The trainer's epochs and schedule: made from the run's data, revised as it becomes known.

Total steps = epochs x steps per epoch, and an epoch takes, per shard, its training rows (held
out and too-short rows left out) / rows per step, rounded up. A shard's count is exact once it
has been trained (the ledger keeps it); the shards not trained yet are estimated from the
manifest's input rows at the rate of training rows per input row seen so far (the gates'
rejections, held-out samples and turns per sample included). Every revision keeps the learning
rate continuous (:class:`~workers.train.drafter.schedule.Schedule`); when every upstream
shard has been trained once the count is exact and the last step is the schedule's last.

When every committed shard has been trained in an epoch and the upstream stage is complete,
the epoch ends: the held-out tau is measured, and the next epoch starts (ledger epoch + 1,
put-once in the next checkpoint) with its shards queued in their seeded order; or training
finishes (the last epoch, ``--patience``) and says why in one line.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from common.choices import Finish, Mode
from common.queue.celery_app import TRAIN, app
from common.queue.dispatch import publish_shard
from common.runs.checkpoints import Ledger
from common.runs.epochs import shard_order
from common.runs.records import RunConfig
from common.runs.store import RunStore
from workers.context import WorkerContext
from workers.train.plan import epoch_steps, planned_total

if TYPE_CHECKING:
    from workers.train.session import Session

log = logging.getLogger(__name__)

# A revision that moves the total by less than this share is logged at debug level only.
QUIET_REVISION = 0.02


def upstream_stage(config: RunConfig) -> str:
    """The stage whose commits the trainer takes: generation online, hidden states offline."""
    return "generate" if config.mode is Mode.ONLINE else "hidden"


def note_shard(ledger: Ledger, shard: int, rows: int, rows_per_step: int) -> None:
    """Record what ``shard`` yields per epoch: its training rows and steps (exact)."""
    ledger.shard_rows[str(shard)] = rows
    ledger.shard_steps[str(shard)] = math.ceil(rows / rows_per_step)


def revise_schedule(ctx: WorkerContext, session: Session, store: RunStore, config: RunConfig,
                    why: str) -> None:
    """Bring the schedule's length to what the data now says (unless --total-steps set it)."""
    schedule, ledger = session.trainer.schedule, session.ledger
    manifest = store.manifest()
    shard_rows = manifest.shard_rows if manifest is not None else []
    rows_per_step = ctx.settings.train.rows_per_step
    # An epoch's steps, whatever the schedule's length: status's hours per epoch.
    session.pace.steps_per_epoch = epoch_steps(ledger, config, shard_rows, rows_per_step)[0]
    if ctx.settings.train.total_steps:
        schedule.revise(ctx.settings.train.total_steps, session.steps)
    else:
        before = schedule.total
        total, basis = planned_total(ledger, config, shard_rows, rows_per_step)
        if schedule.revise(total, session.steps):
            loud = abs(schedule.total - before) > QUIET_REVISION * before or "exact" in basis
            log.log(logging.INFO if loud else logging.DEBUG,
                    "run %s: schedule %d -> %d steps at step %d (%s; %s); the learning rate "
                    "goes on from %.3g", config.run, before, schedule.total, session.steps, why,
                    basis, schedule.factor(session.steps) * session.trainer.config.lr)
    ledger.total_steps = schedule.total


def schedule_spent(ctx: WorkerContext, session: Session, config: RunConfig, shard: int,
                   rows_left: int) -> bool:
    """True when no step is left in the schedule: an explicit --total-steps ran out, so the
    trainer finishes the run (one line); a data schedule is extended instead (never silent)."""
    schedule = session.trainer.schedule
    if session.steps < schedule.total:
        return False
    if ctx.settings.train.total_steps:
        session.ledger.finished = Finish.TOTAL_STEPS
        log.warning("run %s: training finished at step %d, the end of the --total-steps "
                    "schedule, in epoch %d of %d with %d row(s) of shard %d and any later shards "
                    "untrained; unset --total-steps to size the schedule from the data",
                    config.run, session.steps, session.ledger.epoch + 1, config.epochs,
                    rows_left, shard)
        return True
    extra = math.ceil(rows_left / ctx.settings.train.rows_per_step)
    log.warning("run %s: the estimated schedule ended at step %d with %d row(s) of shard %d "
                "left; extended by %d step(s)", config.run, session.steps, rows_left, shard,
                extra)
    schedule.revise(session.steps + extra, session.steps)
    session.ledger.total_steps = schedule.total
    return False


def epoch_complete(store: RunStore, config: RunConfig, ledger: Ledger) -> set[int] | None:
    """The epoch's shards once every one is committed upstream and trained; else None."""
    manifest = store.manifest()
    upstream = store.committed(upstream_stage(config))
    if manifest is None or len(upstream) < manifest.shards:
        return None
    return upstream if upstream <= set(ledger.done) else None


def patience_spent(taus: list[float | None], patience: int | None) -> bool:
    """Whether the last ``patience`` evaluations all failed to beat the best before them."""
    measured = [t for t in taus if t is not None]
    if not patience or len(measured) <= patience:
        return False
    best_before = max(measured[:-patience])
    return all(t <= best_before for t in measured[-patience:])


def end_epoch(ctx: WorkerContext, session: Session, config: RunConfig, shards: set[int],
              tau: float | None) -> bool:
    """Close the ledger's epoch with its held-out ``tau``; True when another epoch starts."""
    ledger = session.ledger
    ledger.tau_by_epoch.append(tau)
    epoch = ledger.epoch + 1
    log.info("run %s: epoch %d of %d done at step %d (%d shards); held-out tau %s; tau by "
             "epoch %s", config.run, epoch, config.epochs, session.steps, len(shards),
             "not measured" if tau is None else f"{tau:.3f}", ledger.tau_by_epoch)
    planned, measured = session.pace.hours()
    if measured is not None:
        log.info("run %s: an epoch takes %.3g h at the measured steps' pace (the plan: %s)",
                 config.run, measured, "none on the CPU" if planned is None else f"{planned:.3g} h")
    if epoch >= config.epochs:
        ledger.finished = Finish.SCHEDULE
        log.info("run %s: training finished: %d epoch(s), %d steps (the schedule's last: %d)",
                 config.run, epoch, session.steps, session.trainer.schedule.total)
        return False
    if patience_spent(ledger.tau_by_epoch, config.patience):
        ledger.finished = Finish.PATIENCE
        log.info("run %s: training finished after epoch %d of %d: %d evaluation(s) without a "
                 "better held-out tau (--patience %d); best %.3f", config.run, epoch,
                 config.epochs, config.patience, config.patience,
                 max(t for t in ledger.tau_by_epoch if t is not None))
        return False
    ledger.epoch, ledger.done = epoch, []
    return True


def queue_epoch(ctx: WorkerContext, config: RunConfig, ledger: Ledger,
                shards: set[int]) -> None:
    """Queue the new epoch's shards in its seeded order (after its checkpoint is stored)."""
    order = shard_order(config.run, ledger.epoch, shards)
    for shard in order:
        publish_shard(app, ctx.redis, TRAIN, config.run, shard)
    log.info("run %s: epoch %d of %d queued: %d shards in a seeded order starting %s",
             config.run, ledger.epoch + 1, config.epochs, len(order), order[:8])
