"""Data-parallel drafter training over torch.distributed: one queue consumer, N ranks.

``dflash-pipeline worker train --nproc-per-node N`` starts N ranks through torch's launcher
(:mod:`workers.train.ranks`). Rank 0 is the group's only Celery consumer. For every step it
drops the short rows and draws the anchors of the whole global batch (``--rows-per-step`` rows,
the draws one rank would make), hands rank ``r`` rows ``r::N`` cut into micro-batches under the
token budget (every rank as many: weight-0 stand-ins pad the shorter lists, so the collectives
stay in step); every rank computes its micro-batches' target features, loss and backward, each
inside the ranks' agreement (an out-of-memory failure anywhere retries the step on all), the
replicas' gradients are all-reduced once the step went through (FSDP2 reduce-scatters each
micro-batch's) and every rank takes the same optimizer step. Each loss is weighted by the
*global* label weight, so N ranks train the same drafter as one rank with the same global batch.
Rank 0 checkpoints the unwrapped drafter (one rank's format: any N resumes it) and reports
metrics reduced over ranks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.choices import RankOrder
from common.errors import GroupLost, NothingToTrain, RankFailed
from common.faults import inject
from workers.train.agreement import Failure, failed_part
from workers.train.drafter.features import FeaturedRow
from workers.train.drafter.microbatch import (
    Accumulated,
    Drawn,
    OutOfMemory,
    label_weight,
    micro_batches,
)
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
            group.send([(RankOrder.SESSION, run, trainer.steps)] * group.world)
        return DataParallelTrainer(trainer, group, run)


def _portable(row: Any) -> Any:
    """A row fit to send: stored features travel on the CPU."""
    return FeaturedRow(row.row, row.features.cpu()) if isinstance(row, FeaturedRow) else row


class DataParallelTrainer:
    """A :class:`DrafterTrainer` whose drafter is a replica (DDP's layout) or an FSDP2 shard on
    every rank of the group."""

    def __init__(self, trainer: DrafterTrainer, group: Group, run: str) -> None:
        self.trainer = trainer
        self.group = group
        self.run = run
        if group.sharded:
            from workers.train.sharding import shard

            shard(trainer)
            return
        # Rank 0's parameters on every rank (the target's heads are not in the tree). No DDP
        # module: every backward here is local (the ranks agree before any collective) and
        # :meth:`_reduce` all-reduces the gradients in place afterwards, so DDP's reducer would
        # only add its buckets, a second float32 copy of the gradients.
        with torch.no_grad():
            for tensor in [*trainer.drafter.parameters(), *trainer.drafter.buffers()]:
                dist.broadcast(tensor, src=0)

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

    @property
    def oom(self) -> OutOfMemory:
        return self.trainer.oom

    def state_dict(self) -> dict[str, Any]:
        """One rank's format; FSDP2 shards are gathered, by every rank (rank 0 calls them)."""
        if not self.group.sharded:
            return self.trainer.state_dict()
        from workers.train.sharding import full_state

        with self.group.in_step(f"run {self.run}: gathering the checkpoint"):
            if self.group.rank == 0:
                self.group.send([(RankOrder.STATE, self.run)] * self.group.world)
            return full_state(self.trainer, keep=self.group.rank == 0)

    def eval_drafter(self) -> Any:
        """A drafter rank 0 can decode with alone: the replica (DDP), or (FSDP2) a whole copy
        gathered from the shards by every rank (rank 0 calls them)."""
        if not self.group.sharded:
            return self.trainer.drafter
        from workers.train.sharding import gathered_drafter

        with self.group.in_step(f"run {self.run}: gathering the drafter for the eval"):
            if self.group.rank == 0:
                self.group.send([(RankOrder.WEIGHTS, self.run)] * self.group.world)
            return gathered_drafter(self.trainer, keep=self.group.rank == 0)

    def step(self, rows: Sequence[Any]) -> StepMetrics:
        """Rank 0: one optimizer step of the whole group on the global batch ``rows``; a
        micro-batch out of memory on any rank, in its forward or backward, retries the step on
        every rank (:class:`OutOfMemory`: half the budget, checkpointing on)."""
        started = time.perf_counter()
        t = self.trainer
        drawn, skipped = t.draw(rows)
        if not drawn:
            raise NothingToTrain(f"all {len(rows)} rows have < {t.min_supervised} "
                                 "supervised tokens")
        t.oom.new_step()
        while True:
            total = float(label_weight(drawn, t.weights, t.block_size))
            parts, real = self._parts(drawn)
            try:
                return self._group_step(parts, real, skipped, total, started)
            except RankFailed as failed:
                drawn = t.after_out_of_memory(drawn, failed_part(failed, parts, real))

    def _parts(self, drawn: list[Drawn]) -> tuple[list[list[list[Drawn]]], list[int]]:
        """Rank ``r``'s micro-batches of rows ``r::N``, and how many are real: every rank runs
        as many (collectives stay in step), a rank with fewer pads with stand-ins of the
        shortest row (weight 0)."""
        t, world = self.trainer, self.group.world
        plans = [micro_batches(drawn[r::world], t.batch_tokens, t.block_size)
                 for r in range(world)]
        count = max(len(plan) for plan in plans)
        stand_in = [min(drawn, key=lambda d: d.tokens)]
        return ([plan + [stand_in] * (count - len(plan)) for plan in plans],
                [len(plan) for plan in plans])

    def _group_step(self, parts: list[list[list[Drawn]]], real: list[int], skipped: int,
                    total: float, started: float) -> StepMetrics:
        """Send each rank its micro-batches and train rank 0's."""
        t = self.trainer
        # The schedule travels with the step: rank 0 alone revises it (workers.train.epochs).
        messages = [([[(_portable(d.row), d.anchors) for d in part] for part in mine],
                     [1.0] * n + [0.0] * (len(mine) - n)) for mine, n in zip(parts, real,
                                                                             strict=True)]
        with self.group.in_step(f"run {self.run}: data-parallel step {t.steps + 1}"):
            self.group.send([(RankOrder.SELF,), *[
                (RankOrder.TRAIN, self.run, part, shares, skipped, total, t.schedule.to_json(),
                 t.oom.recompute) for part, shares in messages[1:]]])
            return self.train_part(*messages[0], skipped, total, started=started)

    def _prepare(self, part: Part) -> Any:
        """This micro-batch's rows packed on this rank's device, and its attention masks."""
        inject("train.forward")
        inject(f"train.forward.rank{self.group.rank}")
        t, drawn = self.trainer, [Drawn(row, anchors) for row, anchors in part]
        batch = t.pack(drawn)
        masks = t.masks(batch)
        if self.group.sharded and t.headroom is not None:
            t.headroom(drawn, t.oom.recompute)
        return batch, masks

    def _own(self, work: Callable[[], Any], part: int) -> Any:
        """Run work without collectives in it; every rank then learns whether any rank failed
        (and where: an out-of-memory micro-batch is retried)."""
        failure, result = None, None
        try:
            result = work()
        except Exception as err:  # shared with the group before anyone leaves the step
            log.exception("rank %d: run %s: step %d failed", self.group.rank, self.run,
                          self.trainer.steps + 1)
            failure = Failure(self.group.rank, part, isinstance(err, torch.OutOfMemoryError),
                              f"rank {self.group.rank}: {err!r}")
        self.group.agree(failure)
        return result

    def _backward(self, loss: torch.Tensor) -> None:
        """This rank's backward (replicas: local); under FSDP2 only the point before it, whose
        failure the ranks agree on before its reduce-scatter."""
        inject(f"train.backward.rank{self.group.rank}")
        if not self.group.sharded:
            loss.backward()

    def _micro_step(self, part: Part, scale: float, index: int) -> tuple[Any, Any, Any]:
        """Forward and backward of one micro-batch, each inside the ranks' agreement: replicas
        run both without collectives (the gradients reduced by :meth:`_reduce`); under FSDP2
        the packing (the target's forward, the mask) and the point before the backward are
        agreed, the forward and backward gather."""
        t = self.trainer
        batch, masks = self._own(lambda: self._prepare(part), index)
        if self.group.sharded:  # FSDP2's forward gathers parameters: a collective of the group
            loss_sum, per_slot = t.forward_sum(batch, masks)
            self._own(lambda: self._backward(loss_sum * scale), index)
            (loss_sum * scale).backward()
            return batch, loss_sum, per_slot
        loss_sum, per_slot = self._own(lambda: t.forward_sum(batch, masks), index)
        self._own(lambda: self._backward(loss_sum * scale), index)
        return batch, loss_sum, per_slot

    def _reduce(self) -> None:
        """Replicas: the accumulated gradients averaged over the group, in place."""
        if self.group.sharded:
            return
        grads = [p.grad for p in self.trainer.drafter.parameters() if p.grad is not None]
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for work in works:
            work.wait()
        for g in grads:
            g.div_(self.group.world)

    def train_part(self, parts: list[Part], shares: list[float], skipped: int, total: float,
                   schedule: dict[str, Any] | None = None, recompute: bool = False,
                   started: float | None = None) -> StepMetrics:
        """Every rank: its micro-batches' forward and backward, then the group's optimizer step.

        ``shares`` 0 marks stand-in micro-batches (a rank with fewer rows than the others);
        ``total`` is the global batch's label weight; ``schedule`` is rank 0's learning-rate
        schedule (ranks > 0 take it); ``recompute``: checkpointing on (a retried step).
        """
        started = time.perf_counter() if started is None else started
        t = self.trainer
        if schedule is not None:
            t.schedule = Schedule.from_json(schedule)
            t.oom.recompute = recompute
        t.optimizer.zero_grad(set_to_none=True)   # a retried step starts clean
        t.drafter.train()
        done = Accumulated()
        for index, (part, share) in enumerate(zip(parts, shares, strict=True)):
            # The group averages gradients over ranks; times world, they sum to the batch's.
            scale = share * self.group.world / total
            batch, loss_sum, per_slot = self._micro_step(part, scale, index)
            if share:
                done.add(loss_sum, per_slot, batch)
            del batch
        self._reduce()
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
        if kind is RankOrder.STOP:
            return
        if kind is RankOrder.SESSION:
            session = new_session(run)
            if session.steps != args[0]:
                raise GroupLost(f"rank {group.rank} resumed run {run} at step {session.steps}, "
                                f"rank 0 at {args[0]}")
            trainers[run] = session.trainer
        elif kind is RankOrder.STATE:
            trainers[run].state_dict()
        elif kind is RankOrder.WEIGHTS:
            trainers[run].eval_drafter()
        else:
            try:
                trainers[run].train_part(*args)
            except RankFailed as failed:  # the group agreed: rank 0 parks the shard
                log.warning("rank %d: run %s: step abandoned: %s", group.rank, run, failed)
