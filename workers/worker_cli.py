"""``dflash-pipeline worker generate|hidden|train``: one Celery worker process per queue and GPU.

Every option is declared once (settings in ``common.config_sections``, the process's own in
``common.cli.options.WorkerOptions``) naming the ``worker QUEUE`` commands that take it; settings
reach the worker through its environment. Each stage's launcher lives in
its folder and joins the ``worker`` group through the ``dflash_pipeline.worker_commands`` entry
points; this module holds the group and the options every launcher shares.
"""

from __future__ import annotations

from typing import Any

import click

from common.cli import common_options, options_for
from common.config import Settings
from common.entry_points import WORKER_COMMANDS, EntryPointGroup
from workers.launch import Launch, exec_worker


def stage_worker(launch: Launch, doc: str) -> click.Command:
    """A one-shard-at-a-time worker of a downstream stage, with the options declared for it
    (``worker QUEUE``: the stage's settings, --gpu, --name, --loglevel)."""

    def command(settings: Settings, gpu: int | None, name: str | None, loglevel: str,
                **overrides: Any) -> None:
        exec_worker(settings, launch, gpu=gpu, concurrency=1, name=name, loglevel=loglevel,
                    overrides=overrides)

    command.__doc__ = doc
    return click.command(launch.queue)(options_for(f"worker {launch.queue}")(
        common_options(command)))


@click.group(cls=EntryPointGroup, entry_group=WORKER_COMMANDS)
def worker() -> None:
    """Start a worker process for one queue."""
