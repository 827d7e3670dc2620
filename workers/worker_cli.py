"""``dflash-pipeline worker generate|hidden|train``: one Celery worker process per queue and GPU.

Options that are settings (``common.config.Settings``) take their default and ``DFLASH_*``
variable from there and reach the worker through its environment. Each stage's launcher lives in
its folder and joins the ``worker`` group through the ``dflash_pipeline.worker_commands`` entry
points; this module holds the group and the options every launcher shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from common.cli import command_option, common_options, setting_option
from common.config import Settings
from common.entry_points import WORKER_COMMANDS, EntryPointGroup
from workers.launch import Launch, exec_worker


def gpu_option(unset: str = "CPU unless a GPU is visible") -> Callable[[Callable[..., Any]], Any]:
    """--gpu; ``unset`` says what the worker runs on without it."""
    return setting_option("gpu", type=click.IntRange(min=0), show_default=False,
                          help=f"GPU index this worker owns (sets CUDA_VISIBLE_DEVICES) "
                               f"[unset: {unset}].")


def node_options(queue: str) -> Callable[[Callable[..., Any]], Any]:
    """--name and --loglevel, the same for every worker kind."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        func = command_option("loglevel", help="Celery log level.")(func)
        return command_option("worker_name", "--name", "name",
                              help=f"Worker node name [default: {queue}-gpuN@host or "
                                   f"{queue}-cpu@host].")(func)

    return wrap


def stage_worker(launch: Launch, doc: str, *options: Callable[[Any], Any]) -> click.Command:
    """A one-shard-at-a-time worker of a downstream stage, with the stage's settings."""
    queue = launch.queue

    def command(settings: Settings, gpu: int | None, name: str | None, loglevel: str,
                **overrides: Any) -> None:
        exec_worker(settings, launch, gpu=gpu, concurrency=1, name=name, loglevel=loglevel,
                    overrides=overrides)

    command.__doc__ = doc
    wrapped = common_options(command)
    for option in (node_options(queue), *reversed(options), gpu_option()):
        wrapped = option(wrapped)
    return click.command(queue)(wrapped)


@click.group(cls=EntryPointGroup, entry_group=WORKER_COMMANDS)
def worker() -> None:
    """Start a worker process for one queue."""
