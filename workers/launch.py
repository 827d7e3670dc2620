"""What every worker launcher shares: the Celery command line and the exec into it."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from common.config import Settings, env_name
from workers.access import check_write_access
from workers.train.group import group_argv, is_group

WORKER_APPS = {"generate": "workers.app", "hidden": "workers.downstream_app",
               "train": "workers.downstream_app"}


def worker_argv(settings: Settings, *, queue: str, gpu: int | None, concurrency: int,
                name: str | None, loglevel: str) -> list[str]:
    """The celery command a worker runs; the threads pool lets held shards share one engine."""
    node = name or (f"{queue}-gpu{gpu}@%h" if gpu is not None else f"{queue}-cpu@%h")
    return [
        sys.executable, "-m", "celery", "-A", WORKER_APPS[queue], "worker",
        "-Q", queue, "-P", "threads", "-c", str(concurrency), "-n", node,
        "-l", loglevel, "-E", "--without-gossip", "--without-mingle",
    ]


def visible_devices(gpu: int, tp: int) -> str:
    """The GPUs a worker owns: ``gpu`` alone, or a tensor-parallel engine's ``tp`` from it."""
    return ",".join(str(gpu + i) for i in range(tp))


def exec_worker(settings: Settings, *, queue: str, gpu: int | None, concurrency: int,
                name: str | None, loglevel: str, overrides: dict[str, Any]) -> None:
    """Replace this process with the Celery worker, so signals reach it directly.

    ``overrides`` are settings fields given as options; the worker reads them from the
    environment like every other setting.
    """
    given = {"storage": settings.storage, "broker_url": settings.broker_url, "gpu": gpu,
             **overrides}
    env = dict(os.environ, **{env_name(k): str(v) for k, v in given.items() if v is not None})
    resolved = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu, resolved.tp if queue == "generate"
                                                      else 1)
    check_write_access(settings.storage, queue)   # a read-only key: one line now, no parking
    group = queue == "train" and is_group(resolved)
    if group and not name:
        name = f"train-x{resolved.train_nproc_per_node}-node{resolved.train_node_rank}@%h"
    argv = worker_argv(settings, queue=queue, gpu=gpu, concurrency=concurrency, name=name,
                       loglevel=loglevel)
    if group:
        argv = group_argv(resolved, gpu, argv)
    os.execve(argv[0], argv, env)
