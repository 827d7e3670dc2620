"""This process's place in a data-parallel training group and the channel rank 0 drives it
through: joining (NCCL on GPUs, gloo on CPU), messages, agreeing on a failure, leaving.

    group = init_group()                 # every rank, once (torch's launcher started them)
    group.send(messages) / group.receive()
    with group.in_step("step 12"): ...   # a failure out of step ends the group
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from common.choices import Parallel, RankOrder
from common.config import load_settings
from common.errors import GroupLost, RankFailed

log = logging.getLogger(__name__)

# Followers wait on the control group between shards, for as long as the queue is empty.
IDLE_TIMEOUT = timedelta(days=365)

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
            # Out of memory past the agreement (inside FSDP2's gathers): the others are left
            # in a collective; the group restarts and the shard resumes from its checkpoint.
            if collective_failure(err) or isinstance(err, torch.OutOfMemoryError):
                raise GroupLost(f"{what} failed on rank {self.rank} ({err!r}); the group stops"
                                ) from err
            raise RankFailed(f"{what} failed on rank {self.rank}: {err!r}") from err

    def agree(self, failure: object | None) -> None:
        """Every rank: share this rank's failure (or None); raise ``RankFailed`` on all if any
        (its text each failure's, the failures themselves with it)."""
        reasons: list[Any] = [None] * self.world
        dist.all_gather_object(reasons, failure, group=self.control)
        failed = [reason for reason in reasons if reason is not None]
        if failed:
            raise RankFailed("; ".join(map(str, failed)), failed)

    def stop(self) -> None:
        """Rank 0, leaving: release the others (unless a failure already ended the group)."""
        if self.broken:
            return
        try:
            self.send([(RankOrder.STOP, "")] * self.world)
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


def current_group() -> Group | None:
    """The group this process joined (None: a single-process trainer)."""
    return _group


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
                   load_settings().train.parallel is Parallel.FSDP)
    log.info("rank %d of %d on %d host(s), backend %s%s", _group.rank, _group.world,
             _group.hosts, dist.get_backend(), ", FSDP2" if _group.sharded else "")
    return _group


def group_fields() -> dict[str, int]:
    """The ``ranks`` and ``hosts`` of the train metrics record (1 and 1 without a group)."""
    return {"ranks": _group.world if _group else 1, "hosts": _group.hosts if _group else 1}
