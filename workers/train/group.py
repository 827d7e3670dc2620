"""A data-parallel train worker: torch's launcher starts its ranks; the checks it needs first."""

from __future__ import annotations

import sys

from common.choices import Parallel
from common.config import Settings
from common.errors import ConfigError
from workers.launch import Launch


def is_group(settings: Settings) -> bool:
    """Whether the train worker runs as a group of ranks; --fsdp needs one."""
    group = settings.train.nproc_per_node > 1 or settings.train.nnodes > 1
    if settings.train.parallel is Parallel.FSDP and not group:
        raise ConfigError("--fsdp shards the drafter over ranks: it needs --nproc-per-node or "
                          "--nnodes above 1")
    return group


def group_argv(settings: Settings, gpu: int | None, celery_argv: list[str]) -> list[str]:
    """torch's launcher starting the ranks of a data-parallel train worker, rank 0 the consumer."""
    nodes, rank = settings.train.nnodes, settings.train.node_rank
    if gpu is not None:
        raise ConfigError("--gpu names one GPU; a training group takes its GPUs from "
                          "CUDA_VISIBLE_DEVICES (one rank each)")
    if nodes > 1 and not settings.train.rdzv_endpoint:
        raise ConfigError(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT of node rank 0")
    if rank >= nodes:
        raise ConfigError(f"--node-rank {rank} is not below --nnodes {nodes}")
    where = (["--nnodes", str(nodes), "--node-rank", str(rank), "--rdzv-endpoint",
              settings.train.rdzv_endpoint] if settings.train.rdzv_endpoint else ["--standalone"])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(settings.train.nproc_per_node), *where, "-m", "workers.train.ranks",
            *celery_argv[3:]]


def group_node(settings: Settings) -> str | None:
    """A group's node name (one consumer for all its ranks); None: the launcher's own."""
    if not is_group(settings):
        return None
    return f"train-x{settings.train.nproc_per_node}-node{settings.train.node_rank}@%h"


def train_argv(settings: Settings, gpu: int | None, celery_argv: list[str]) -> list[str]:
    """The celery argv, or torch's launcher starting the group's ranks around it."""
    return group_argv(settings, gpu, celery_argv) if is_group(settings) else celery_argv


# Expandable segments: the allocator grows a segment instead of stranding fragments between
# steps of different lengths (the memory plan's fragmentation share assumes them).
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

TRAIN_LAUNCH = Launch("train", app="workers.downstream_app", preflight=is_group, node=group_node,
                      argv=train_argv, environ=(ALLOC_CONF,))
