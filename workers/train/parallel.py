"""Data-parallel drafter training over torch.distributed: one queue consumer, N ranks.

``dflash-pipeline worker train --nproc-per-node N`` starts N ranks through torch's launcher
(:mod:`workers.train.ranks`). Rank 0 is the group's only Celery consumer. For every step it
drops the short rows and draws the anchors of the whole global batch (``--rows-per-step``
rows, the draws one rank would make), hands rank ``r`` rows ``r::N`` cut into micro-batches
under the token budget (every rank as many: weight-0 stand-ins pad the shorter lists, so the
collectives stay in step); every rank computes its micro-batches' target features, loss and
backward, DDP all-reduces the gradients on the last (FSDP2 reduce-scatters each) and every rank
takes the same optimizer step. Each loss is weighted by the *global* label weight, so N
ranks train the same drafter as one rank with the same global batch. Rank 0 checkpoints the
unwrapped drafter (one rank's format: any N resumes it) and reports metrics reduced over ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.errors import GroupLost, NothingToTrain, RankFailed
from common.faults import inject
from workers.train.drafter.features import FeaturedRow
from workers.train.drafter.microbatch import Accumulated, Drawn, label_weight, micro_batches
from workers.train.drafter.recipe import StepMetrics, TrainConfig
from workers.train.drafter.schedule import Schedule
from workers.train.drafter.train import DrafterTrainer
from workers.train.process_group import Group, current_group

log = logging.getLogger(__name__)

Part = list[tuple[Any, torch.Tensor]]   # a micro-batch's rows (plain or featured), anchors


def distribute(trainer: DrafterTrainer, run: str) -> DrafterTrainer | DataParallelTrainer:
    """The session's trainer, replicated over the group when there is one."""
    group = current_group()
    if group is None:
        return trainer
    with group.in_step(f"run {run}: starting the data-parallel trainer"):
        if group.rank == 0:   # the others build the same session from storage, then join us
            group.send([("session", run, trainer.steps)] * group.world)
        return DataParallelTrainer(trainer, group, run)


def _portable(row: Any) -> Any:
    """A row fit to send: stored features travel on the CPU."""
    return FeaturedRow(row.row, row.features.cpu()) if isinstance(row, FeaturedRow) else row


def _out_of_memory(failed: RankFailed) -> bool:
    """Whether a rank's agreed failure was torch's out-of-memory error."""
    return "OutOfMemoryError" in str(failed)


class DataParallelTrainer:
    """A :class:`DrafterTrainer` whose drafter is a DDP replica (or an FSDP2 shard) on every
    rank of the group."""

    def __init__(self, trainer: DrafterTrainer, group: Group, run: str) -> None:
        self.trainer = trainer
        self.group = group
        self.run = run
        device = trainer.device
        if group.sharded:
            from workers.train.sharding import shard

            shard(trainer)
            return
        # Construction broadcasts rank 0's parameters; the target's heads are not in the tree.
        # Gradients are the buckets themselves (no second copy of them).
        trainer.module = DistributedDataParallel(
            trainer.drafter, device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False, gradient_as_bucket_view=True)

    @property
    def drafter(self) -> Any:
        return self.trainer.drafter

    @property
    def steps(self) -> int:
        return self.trainer.steps

    @property
    def schedule(self) -> Schedule:
        return self.trainer.schedule

    @property
    def config(self) -> TrainConfig:
        return self.trainer.config

    @property
    def min_supervised(self) -> int:
        return self.trainer.min_supervised

    def state_dict(self) -> dict[str, Any]:
        """One rank's format; FSDP2 shards are gathered, by every rank (rank 0 calls them)."""
        if not self.group.sharded:
            return self.trainer.state_dict()
        from workers.train.sharding import full_state

        with self.group.in_step(f"run {self.run}: gathering the checkpoint"):
            if self.group.rank == 0:
                self.group.send([("state", self.run)] * self.group.world)
            return full_state(self.trainer, keep=self.group.rank == 0)

    def eval_drafter(self) -> Any:
        """A drafter rank 0 can decode with alone: the replica (DDP), or (FSDP2) a whole copy
        gathered from the shards by every rank (rank 0 calls them)."""
        if not self.group.sharded:
            return self.trainer.drafter
        from workers.train.sharding import gathered_drafter

        with self.group.in_step(f"run {self.run}: gathering the drafter for the eval"):
            if self.group.rank == 0:
                self.group.send([("weights", self.run)] * self.group.world)
            return gathered_drafter(self.trainer, keep=self.group.rank == 0)

    def step(self, rows: Sequence[Any]) -> StepMetrics:
        """Rank 0: one optimizer step of the whole group on the global batch ``rows``; an
        out-of-memory micro-batch on any rank retries the step once at half the budget."""
        started = time.perf_counter()
        t = self.trainer
        drawn, skipped = t.draw(rows)
        if not drawn:
            raise NothingToTrain(f"all {len(rows)} rows have < {t.min_supervised} "
                                 "supervised tokens")
        total = float(label_weight(drawn, t.weights, t.block_size))
        try:
            return self._group_step(drawn, skipped, total, t.batch_tokens, started)
        except RankFailed as failed:
            if not _out_of_memory(failed):
                raise
            return self._group_step(drawn, skipped, total, t.halve_budget(drawn), started)

    def _group_step(self, drawn: list[Drawn], skipped: int, total: float, budget: int,
                    started: float) -> StepMetrics:
        """Rank ``r`` trains rows ``r::N`` in micro-batches; every rank runs as many (collectives
        stay in step), a rank with fewer pads with weight-0 stand-ins of the shortest row."""
        t, world = self.trainer, self.group.world
        plans = [micro_batches(drawn[r::world], budget, t.block_size) for r in range(world)]
        count = max(len(plan) for plan in plans)
        stand_in = [min(drawn, key=lambda d: d.tokens)]
        # The schedule travels with the step: rank 0 alone revises it (workers.train.epochs).
        messages = [([[(_portable(d.row), d.anchors) for d in part]
                      for part in plan + [stand_in] * (count - len(plan))],
                     [1.0] * len(plan) + [0.0] * (count - len(plan))) for plan in plans]
        with self.group.in_step(f"run {self.run}: data-parallel step {t.steps + 1}"):
            self.group.send([("self",), *[("step", self.run, parts, shares, skipped, total,
                                           t.schedule.to_json())
                                          for parts, shares in messages[1:]]])
            return self.train_part(*messages[0], skipped, total, started=started)

    def _prepare(self, part: Part) -> Any:
        """This micro-batch's rows as a packed batch on this rank's device."""
        inject("train.forward")
        inject(f"train.forward.rank{self.group.rank}")
        return self.trainer.pack([Drawn(row, anchors) for row, anchors in part])

    def _own(self, work: Callable[[], Any]) -> Any:
        """Run work without collectives in it; every rank then learns whether any rank failed."""
        failure, result = None, None
        try:
            result = work()
        except Exception as err:  # shared with the group before anyone leaves the step
            log.exception("rank %d: run %s: step %d failed", self.group.rank, self.run,
                          self.trainer.steps + 1)
            failure = f"rank {self.group.rank}: {err!r}"
        self.group.agree(failure)
        return result

    def _micro_step(self, part: Part, scale: float, last: bool) -> tuple[Any, Any, Any]:
        """Forward and backward of one micro-batch; the gradients are reduced over the group
        on the last (DDP) or on each (FSDP2, which keeps them sharded)."""
        t = self.trainer
        batch = self._own(lambda: self._prepare(part))
        if self.group.sharded:  # FSDP2's forward gathers parameters: a collective of the group
            loss_sum, per_slot = t.forward_sum(batch)
            (loss_sum * scale).backward()
            return batch, loss_sum, per_slot
        loss_sum, per_slot = self._own(lambda: t.forward_sum(batch))
        if last:
            (loss_sum * scale).backward()   # DDP's all-reduce runs in this backward
        else:
            def local() -> None:
                with cast(DistributedDataParallel, t.module).no_sync():
                    (loss_sum * scale).backward()
            self._own(local)
        return batch, loss_sum, per_slot

    def train_part(self, parts: list[Part], shares: list[float], skipped: int, total: float,
                   schedule: dict[str, Any] | None = None,
                   started: float | None = None) -> StepMetrics:
        """Every rank: its micro-batches' forward and backward, then the group's optimizer step.

        ``shares`` 0 marks stand-in micro-batches (a rank with fewer rows than the others);
        ``total`` is the global batch's label weight; ``schedule`` is rank 0's learning-rate
        schedule (ranks > 0 take it).
        """
        started = time.perf_counter() if started is None else started
        t = self.trainer
        if schedule is not None:
            t.schedule = Schedule.from_json(schedule)
        t.optimizer.zero_grad(set_to_none=True)   # a retried step starts clean
        t.drafter.train()
        done = Accumulated()
        for index, (part, share) in enumerate(zip(parts, shares, strict=True)):
            # DDP and FSDP2 average gradients over ranks; times world, they sum to the batch's.
            scale = share * self.group.world / total
            batch, loss_sum, per_slot = self._micro_step(part, scale, index == len(parts) - 1)
            if share:
                done.add(loss_sum, per_slot, batch)
        grad_norm, lr = t.optimizer_step()
        return self._reduced(done, skipped, total, grad_norm, lr, started)

    def _reduced(self, done: Accumulated, skipped: int, total: float, grad_norm: Any, lr: float,
                 started: float) -> StepMetrics:
        """The step's metrics summed over the group (every rank calls it)."""
        t, b = self.trainer, self.trainer.block_size
        loss = done.loss_sum if done.loss_sum is not None else torch.zeros((), device=t.device)
        per_slot = done.per_slot if done.per_slot is not None else torch.zeros(
            2, b, device=t.device)
        counts = torch.tensor([done.rows, done.blocks, done.tokens], device=t.device)
        stats = torch.cat([(loss.detach() / total).reshape(1).float(), per_slot.flatten(),
                           counts.float()])
        dist.all_reduce(stats)
        values = stats.tolist()
        correct, totals = values[1:1 + b], values[1 + b:1 + 2 * b]
        accuracy = tuple(c / n if n else float("nan")
                         for c, n in zip(correct[1:], totals[1:], strict=True))
        rows_n, blocks, tokens = (round(v) for v in values[1 + 2 * b:])
        return StepMetrics(step=t.steps, loss=values[0], slot_accuracy=accuracy, lr=lr,
                           grad_norm=float(grad_norm), rows=rows_n, skipped_rows=skipped,
                           blocks=blocks, labels=round(sum(totals)), tokens=tokens,
                           seconds=time.perf_counter() - started)


def follow(group: Group, new_session: Callable[[str], Any]) -> None:
    """Ranks > 0: build the sessions (``new_session(run)``, as rank 0 built its own) and train
    the parts rank 0 sends, until it says stop."""
    trainers: dict[str, DataParallelTrainer] = {}
    while True:
        kind, run, *args = group.receive()
        if kind == "stop":
            return
        if kind == "session":
            session = new_session(run)
            if session.steps != args[0]:
                raise GroupLost(f"rank {group.rank} resumed run {run} at step {session.steps}, "
                                f"rank 0 at {args[0]}")
            trainers[run] = session.trainer
        elif kind == "state":
            trainers[run].state_dict()
        elif kind == "weights":
            trainers[run].eval_drafter()
        else:
            try:
                trainers[run].train_part(*args)
            except RankFailed as failed:  # the group agreed: rank 0 parks the shard
                log.warning("rank %d: run %s: step abandoned: %s", group.rank, run, failed)
