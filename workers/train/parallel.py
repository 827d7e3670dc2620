"""Data-parallel drafter training over torch.distributed: one queue consumer, N ranks.

``dflash-pipeline worker train --nproc-per-node N`` starts N ranks through torch's launcher
(:mod:`workers.train.ranks`). Rank 0 is the group's only Celery consumer. For every step it
drops the short rows and draws the anchors of the whole global batch (``--rows-per-step``
rows, the draws one rank would make) and hands rank ``r`` rows ``r::N``; every rank computes
its rows' target features, loss and backward, DDP all-reduces the gradients and every rank
takes the same optimizer step. Each rank's loss is weighted by the *global* label weight, so N
ranks train the same drafter as one rank with the same global batch. Rank 0 checkpoints the
unwrapped drafter (one rank's format: any N resumes it) and reports metrics reduced over ranks.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.config import load_settings
from common.errors import GroupLost, NothingToTrain, RankFailed
from common.faults import inject
from common.runs.trainrows import TrainingRow
from workers.train.drafter.blocks import pack_rows, sample_anchors
from workers.train.drafter.features import FeaturedRow, with_target_features
from workers.train.drafter.schedule import Schedule
from workers.train.drafter.train import DrafterTrainer, StepMetrics
from workers.train.trainer import plain_row

log = logging.getLogger(__name__)

# Followers wait on the control group between shards, for as long as the queue is empty.
IDLE_TIMEOUT = timedelta(days=365)

Part = list[tuple[Any, torch.Tensor]]   # one rank's rows (plain or featured) and their anchors


@dataclass
class Group:
    """This process's place in the training group, and the channel rank 0 drives it through."""

    rank: int
    world: int
    hosts: int
    control: Any   # a gloo group: rank 0's messages to the others (objects, never on a GPU)
    sharded: bool = False   # --fsdp: FSDP2 shards instead of DDP replicas
    broken: bool = False

    def send(self, messages: Sequence[Any]) -> Any:
        """Rank 0: message ``i`` to rank ``i`` (its own is returned)."""
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, list(messages), src=0, group=self.control)
        return mine[0]

    def receive(self) -> Any:
        """Ranks > 0: the next message from rank 0."""
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, None, src=0, group=self.control)
        return mine[0]

    @contextmanager
    def in_step(self, what: str) -> Iterator[None]:
        """Collectives of the whole group. A failure the ranks agreed on (:meth:`agree`) leaves
        them in step: the shard parks. Any other leaves them out of step, so it ends the group
        (this rank stops; the launcher stops the others): a collective's failure is retried
        (``GroupLost``), this rank's own parks the shard with its reason."""
        try:
            yield
        except RankFailed:
            raise
        except Exception as err:
            self.broken = True
            os.kill(os.getpid(), signal.SIGTERM)
            if collective_failure(err):
                raise GroupLost(f"{what} failed on rank {self.rank} ({err!r}); the group stops"
                                ) from err
            raise RankFailed(f"{what} failed on rank {self.rank}: {err!r}") from err

    def agree(self, failure: str | None) -> None:
        """Every rank: share this rank's failure (or None); raise ``RankFailed`` on all if any."""
        reasons: list[Any] = [None] * self.world
        dist.all_gather_object(reasons, failure, group=self.control)
        failed = [reason for reason in reasons if reason]
        if failed:
            raise RankFailed("; ".join(failed))

    def stop(self) -> None:
        """Rank 0, leaving: release the others (unless a failure already ended the group)."""
        if self.broken:
            return
        try:
            self.send([("stop", "")] * self.world)
        except (dist.DistError, RuntimeError) as err:
            self.broken = True
            log.warning("the other ranks are gone already: %s", err)

    def close(self, together: bool = True) -> None:
        """Every rank, leaving: tear the process groups down before the interpreter does (left
        to exit, gloo's threads can abort the process with "terminate called ..."). Leaving
        ``together`` (all ranks are), in step first, so that no rank tears its pairs down
        while a peer still uses them."""
        try:
            if together and not self.broken:
                dist.barrier(group=self.control)
            dist.destroy_process_group()
        except (dist.DistError, RuntimeError, ValueError) as err:
            log.warning("rank %d: process group teardown: %s", self.rank, err)


def exit_rank(code: int) -> NoReturn:
    """End a rank whose group is closed, before the interpreter's teardown: objects that still
    hold the process groups (FSDP2's modules, their pending work) are freed there, and gloo's
    threads can then abort the process ("terminate called ...") after its work is done."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_group: Group | None = None


def collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is the group's (a peer gone, a broken transport), not this rank's own."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(word in str(err) for word in _COLLECTIVE_WORDS))


# What gloo and NCCL put in the RuntimeErrors they raise when a peer or the transport fails.
_COLLECTIVE_WORDS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer",
                     "Timed out waiting", "ProcessGroup")


def init_group() -> Group:
    """Join the group the launcher started (NCCL on GPUs, gloo on CPU)."""
    global _group
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # NCCL for the GPUs' tensors, gloo for any CPU ones (DFLASH_HIDDEN_DEVICE=cpu, objects).
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname(), group=control)
    _group = Group(dist.get_rank(), dist.get_world_size(), len(set(names)), control,
                   load_settings().train.parallel == "fsdp")
    log.info("rank %d of %d on %d host(s), backend %s%s", _group.rank, _group.world,
             _group.hosts, dist.get_backend(), ", FSDP2" if _group.sharded else "")
    return _group


def group_fields() -> dict[str, int]:
    """The ``ranks`` and ``hosts`` of the train metrics record (1 and 1 without a group)."""
    return {"ranks": _group.world if _group else 1, "hosts": _group.hosts if _group else 1}


def distribute(trainer: DrafterTrainer, target: Any, pad_id: int,
               run: str) -> DrafterTrainer | DataParallelTrainer:
    """The session's trainer, replicated over the group when there is one."""
    if _group is None:
        return trainer
    featurize = functools.partial(with_target_features, target,
                                  layer_ids=list(trainer.drafter.config.target_layer_ids),
                                  pad_id=pad_id)
    with _group.in_step(f"run {run}: starting the data-parallel trainer"):
        if _group.rank == 0:   # the others build the same session from storage, then join us
            _group.send([("session", run, trainer.steps)] * _group.world)
        return DataParallelTrainer(trainer, _group, featurize, run)


def _portable(row: Any) -> Any:
    """A row fit to send: stored features travel on the CPU."""
    return FeaturedRow(row.row, row.features.cpu()) if isinstance(row, FeaturedRow) else row


class DataParallelTrainer:
    """A :class:`DrafterTrainer` whose drafter is a DDP replica (or an FSDP2 shard) on every
    rank of the group."""

    featurizes = True   # each rank computes its share's target features itself

    def __init__(self, trainer: DrafterTrainer, group: Group,
                 featurize: Callable[[list[TrainingRow]], list[FeaturedRow]], run: str) -> None:
        self.trainer = trainer
        self.group = group
        self.featurize = featurize
        self.run = run
        device = trainer.device
        if group.sharded:
            from workers.train.sharding import shard

            shard(trainer)
            return
        # Construction broadcasts rank 0's parameters; the target's heads are not in the tree.
        trainer.module = DistributedDataParallel(
            trainer.drafter, device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False)

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

    def step(self, rows: Sequence[Any]) -> StepMetrics:
        """Rank 0: one optimizer step of the whole group on the global batch ``rows``."""
        started = time.perf_counter()
        t = self.trainer
        keep = [r for r in rows if plain_row(r).supervised_tokens >= t.min_supervised]
        if not keep:
            raise NothingToTrain(f"all {len(rows)} rows have < {t.min_supervised} "
                                 "supervised tokens")
        anchors = [sample_anchors(torch.tensor(plain_row(r).loss_mask), t.config.max_anchors,
                                  t.generator) for r in keep]
        pairs = list(zip(keep, anchors, strict=True))
        parts = [pairs[i::self.group.world] for i in range(self.group.world)]
        skipped = len(rows) - len(keep)
        # The schedule travels with the step: rank 0 alone revises it (workers.train.epochs).
        messages = [("step", self.run, [(_portable(r), a) for r, a in part or pairs[:1]],
                     skipped, 1.0 if part else 0.0, t.schedule.to_json())
                    for part in parts[1:]]
        with self.group.in_step(f"run {self.run}: data-parallel step {t.steps + 1}"):
            self.group.send([("self",), *messages])
            return self.train_part(parts[0], skipped, 1.0, started=started)

    def _prepare(self, part: Part, share: float) -> tuple[Any, torch.Tensor]:
        """This rank's rows as a packed batch on its device, and their loss weight."""
        t = self.trainer
        inject("train.forward")
        inject(f"train.forward.rank{self.group.rank}")
        rows = [r for r, _ in part]
        if all(isinstance(r, FeaturedRow) for r in rows):
            featured = [FeaturedRow(r.row, r.features.to(t.device)) for r in rows]
        else:
            featured = self.featurize([plain_row(r) for r in rows])
        batch = pack_rows([f.row for f in featured], [f.features for f in featured],
                          [a for _, a in part], t.block_size,
                          t.drafter.config.mask_token_id).to(t.device)
        return batch, t.weights[batch.valid.nonzero()[:, 1]].sum() * share

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

    def train_part(self, part: Part, skipped: int, share: float,
                   schedule: dict[str, Any] | None = None,
                   started: float | None = None) -> StepMetrics:
        """Every rank: forward and backward on its part, then the group's optimizer step.

        ``share`` 0 marks a stand-in row of a rank that got none (fewer rows than ranks);
        ``schedule`` is rank 0's learning-rate schedule (ranks > 0 take it).
        """
        started = time.perf_counter() if started is None else started
        t = self.trainer
        if schedule is not None:
            t.schedule = Schedule.from_json(schedule)
        batch, weight = self._own(lambda: self._prepare(part, share))
        t.drafter.train()
        if self.group.sharded:  # FSDP2's forward gathers parameters: a collective of the group
            loss, per_slot = t.forward(batch)
        else:
            loss, per_slot = self._own(lambda: t.forward(batch))
        total = weight.detach().clone()
        dist.all_reduce(total)
        scale = weight / total
        # DDP averages gradients over ranks; times world, they sum to the global batch's.
        (loss * scale * self.group.world).backward()
        grad_norm, lr = t.optimizer_step()
        counts = torch.tensor([batch.rows, batch.blocks, batch.tokens], device=t.device)
        stats = torch.cat([(loss.detach() * scale).reshape(1).float(), per_slot.flatten(),
                           counts.float() * share])
        dist.all_reduce(stats)
        values = stats.tolist()
        b = t.block_size
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
        else:
            try:
                trainers[run].train_part(*args)
            except RankFailed as failed:  # the group agreed: rank 0 parks the shard
                log.warning("rank %d: run %s: step abandoned: %s", group.rank, run, failed)
