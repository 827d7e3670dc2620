"""One run's training state in a train worker process: built from storage, resumed, or fresh.

The train task (:mod:`workers.train.task`) keeps one session per run; the ranks > 0 of a
data-parallel group build the same session from storage (:func:`follower_session`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.config import env_name
from common.runs.checkpoints import Ledger, latest_step, load_checkpoint
from common.runs.records import RunConfig
from common.runs.store import RunStore
from workers.context import WorkerContext, get_context
from workers.devices import resolve_device
from workers.train.pace import EpochPace
from workers.train.parallel import distribute
from workers.train.periodic_eval import PeriodicEval

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from common.plan.verdict import TrainingPlan
    from workers.train.trainer import Trainer

log = logging.getLogger(__name__)

_sessions: dict[str, Session] = {}
_sessions_lock = threading.Lock()


@dataclass
class Session:
    """One run's training state in this process: target, trainer, ledger, checkpoint cadence."""

    run: str
    target: PreTrainedModel
    trainer: Trainer
    ledger: Ledger
    layer_ids: list[int]
    pad_id: int
    last_checkpoint: int
    heldout: frozenset[str] = frozenset()
    evaluator: PeriodicEval | None = None
    step_seconds: float = 0.0   # wall time per step, smoothed (the ETA's rate)
    last_step_at: float = 0.0
    plan: TrainingPlan | None = None   # this rank's memory plan (None on the CPU)
    config_max_tokens: int | None = None   # the run's --max-train-tokens (None: whole rows)
    # An epoch's hours: the plan's and the measured steps' (status shows both).
    pace: EpochPace = field(default_factory=lambda: EpochPace(None))

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def eta_s(self) -> float:
        """Seconds to the schedule's end at the recent pace (called once per step)."""
        now = time.monotonic()
        if self.last_step_at:
            took = now - self.last_step_at
            self.step_seconds = took if not self.step_seconds else (
                0.9 * self.step_seconds + 0.1 * took)
        self.last_step_at = now
        return max(0, self.trainer.schedule.total - self.steps) * self.step_seconds


def get_session(ctx: WorkerContext, config: RunConfig) -> Session:
    """The run's session in this process: resumed from its newest checkpoint, or fresh."""
    with _sessions_lock:
        session = _sessions.get(config.run)
        newest = latest_step(ctx.storage, config.run)
        if session is None or (newest is not None and newest > session.last_checkpoint):
            # First shard here, or another worker trained since: start from storage's state.
            _sessions[config.run] = new_session(ctx, config)
        return _sessions[config.run]


def new_session(ctx: WorkerContext, config: RunConfig) -> Session:
    """The run's session built from storage: the newest checkpoint, or a new drafter."""
    from common.engine.models import resolve_model_path
    from workers.train.drafter.features import target_features
    from workers.train.drafter.model import add_mask_token
    from workers.train.drafter.origin import (
        check_same_shape,
        describe,
        frozen_origin,
        new_drafter,
        origin_phrase,
    )
    from workers.train.drafter.recipe import TrainConfig
    from workers.train.drafter.target_loader import load_target
    from workers.train.drafter.train import DrafterTrainer
    from workers.train.memory import check_resident, configure, rank_plan

    path = resolve_model_path(ctx.settings.replace(model=config.model))
    device = resolve_device(ctx.settings.train.device, env_name("train_device"))
    target, tokenizer = load_target(path, device)
    target.requires_grad_(False)
    mask_id = add_mask_token(tokenizer, target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    origin = frozen_origin(config)
    layers = list(config.target_layer_ids or ())
    resumed = load_checkpoint(ctx.storage, config.run, device=str(target.device))
    if resumed is not None:
        state, ledger = resumed
        trainer = DrafterTrainer.from_state_dict(state, target)
        check_same_shape(config.run, trainer.drafter.config, target, mask_id, layers, origin)
        log.info("run %s: resumed the drafter from step %d (%d shards done)", config.run,
                 trainer.steps, len(ledger.done))
    else:
        drafter = new_drafter(target, mask_id, layers, origin)
        ledger = Ledger()
        trainer = DrafterTrainer(drafter, TrainConfig(
            total_steps=first_total(ctx, config, ledger),
            min_supervised_tokens=ctx.settings.train.min_supervised_tokens,
            max_anchors=ctx.settings.train.max_anchors))
        log.info("run %s: new drafter %s%s", config.run, describe(drafter.config),
                 origin_phrase(origin))
    layers = list(trainer.drafter.config.target_layer_ids)
    plan = rank_plan(ctx.settings, config, target, trainer.drafter.config)
    check_resident(plan, config.run)
    configure(trainer, plan, ctx.settings)
    trainer.featurize = functools.partial(target_features, target, layer_ids=layers,
                                          pad_id=pad_id)
    ranked = distribute(trainer, config.run)
    manifest = RunStore(ctx.storage, config.run).manifest()
    heldout = manifest.heldout_ids if manifest is not None else frozenset()
    return Session(config.run, target, ranked, ledger, layers, pad_id, ranked.steps, heldout,
                   PeriodicEval.for_run(ctx, config, manifest, target, tokenizer), plan=plan,
                   config_max_tokens=config.max_train_tokens, pace=EpochPace(plan))


def first_total(ctx: WorkerContext, config: RunConfig, ledger: Ledger) -> int:
    """A new drafter's schedule length: --total-steps, else the data's first estimate."""
    from workers.train.plan import planned_total

    if ctx.settings.train.total_steps:
        return ctx.settings.train.total_steps
    manifest = RunStore(ctx.storage, config.run).manifest()
    total, basis = planned_total(ledger, config, manifest.shard_rows if manifest else [],
                                 ctx.settings.train.rows_per_step)
    log.info("run %s: schedule of %d steps (%s)", config.run, total, basis)
    return total


def follower_session(run: str) -> Session:
    """Ranks > 0 of a group: the run's session built from storage, as rank 0 built its own."""
    ctx = get_context()
    return new_session(ctx, RunStore(ctx.storage, run).config())
