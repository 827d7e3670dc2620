"""What every worker launcher shares: the Celery command line and the exec into it.

Each stage's command describes itself in a :class:`Launch` (its queue, Celery app, the GPUs a
worker takes, its own preflight and how it wraps the Celery argv); this module names no stage.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.config import Settings, env_name
from common.engine.serving import visible_devices
from workers.access import check_write_access


def _no_preflight(settings: Settings) -> None:
    return None


def _as_is(settings: Settings, gpu: int | None, argv: list[str]) -> list[str]:
    return argv


@dataclass(frozen=True)
class Launch:
    """A stage's worker as the launcher starts it."""

    queue: str
    app: str                                     # the Celery app module (``-A``)
    gpus: Callable[[Settings], int] = lambda settings: 1   # GPUs a worker takes from --gpu
    preflight: Callable[[Settings], object] = _no_preflight  # refuse bad settings in one line
    node: Callable[[Settings], str | None] = lambda settings: None   # its default node name
    argv: Callable[[Settings, int | None, list[str]], list[str]] = _as_is   # wraps celery's
    # Variables the worker gets unless the user set them (the train worker's allocator).
    environ: tuple[tuple[str, str], ...] = ()


def worker_argv(launch: Launch, *, gpu: int | None, concurrency: int, name: str | None,
                loglevel: str) -> list[str]:
    """The celery command a worker runs; the threads pool lets held shards share one engine."""
    queue = launch.queue
    node = name or (f"{queue}-gpu{gpu}@%h" if gpu is not None else f"{queue}-cpu@%h")
    return [
        sys.executable, "-m", "celery", "-A", launch.app, "worker",
        "-Q", queue, "-P", "threads", "-c", str(concurrency), "-n", node,
        "-l", loglevel, "-E", "--without-gossip", "--without-mingle",
    ]


def exec_worker(settings: Settings, launch: Launch, *, gpu: int | None, concurrency: int,
                name: str | None, loglevel: str, overrides: dict[str, Any]) -> None:
    """Replace this process with the Celery worker, so signals reach it directly.

    ``overrides`` are settings fields given as options; the worker reads them from the
    environment like every other setting.
    """
    given = {"storage": settings.broker.storage, "broker_url": settings.broker.url, "gpu": gpu,
             **overrides}
    env = dict(os.environ, **{env_name(k): str(v) for k, v in given.items() if v is not None})
    for variable, value in launch.environ:
        env.setdefault(variable, value)
    resolved = settings.replace(**{k: v for k, v in overrides.items() if v is not None})
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu, launch.gpus(resolved))
    # A read-only key: one line now, no parking.
    check_write_access(settings.broker.storage, launch.queue)
    launch.preflight(resolved)
    argv = worker_argv(launch, gpu=gpu, concurrency=concurrency,
                       name=name or launch.node(resolved), loglevel=loglevel)
    argv = launch.argv(resolved, gpu, argv)
    os.execve(argv[0], argv, env)
