"""Package entry points: what a higher layer hands common/ without common/ naming it.

The stages declare their commands in ``pyproject.toml`` (``[project.entry-points."GROUP"]``,
``name = "module:attr"``), so the group that shows them names no stage module; a command's
module is imported only when the command runs or ``--help`` lists it. The embedded models'
builder reaches :mod:`common.engine.models` the same way (:data:`MODEL_BUILDERS`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from functools import cached_property
from typing import Any

import click

from common.errors import ConfigError

log = logging.getLogger(__name__)

COMMANDS = "dflash_pipeline.commands"                # top-level: worker, export-drafter, ...
WORKER_COMMANDS = "dflash_pipeline.worker_commands"  # under `worker`: generate, hidden, train
# `tiny`: (cache_dir, model name) -> the embedded model's directory, built on first use.
MODEL_BUILDERS = "dflash_pipeline.model_builders"
TINY_BUILDER = "tiny"


def entry_points_of(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of ``group`` by name, every distribution's, not only the first of a
    name: a stale ``*.egg-info`` in a checkout on ``sys.path`` would otherwise hide the
    installed metadata."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points.select(group=group):
            found.setdefault(entry.name, entry)
    return found


def load_entry(group: str, name: str) -> object:
    """The object registered as ``name`` in ``group``; a missing one names the fix."""
    entry = entry_points_of(group).get(name)
    if entry is None:
        raise ConfigError(f"nothing is registered as {name!r} under the {group!r} entry points: "
                          "install the package (pip install -e .)")
    return entry.load()


class EntryPointGroup(click.Group):
    """A group with its own commands plus those of the entry-point group ``entry_group``."""

    def __init__(self, *args: Any, entry_group: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entry_group = entry_group

    @cached_property
    def entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return entry_points_of(self.entry_group)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.entry_points})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            return command
        entry = self.entry_points.get(name)
        if entry is None:
            if not self.entry_points:
                # Run from a checkout whose package metadata is missing or stale.
                raise click.UsageError(
                    f"no such command {name!r}, and no command is registered under the "
                    f"{self.entry_group!r} entry points: install the package (pip install -e .)",
                    ctx)
            return None
        try:
            command = entry.load()
        except Exception as exc:  # any import error of the stage's module: one clear line
            log.info("entry point %s failed to load", entry.value, exc_info=True)
            raise click.ClickException(
                f"command {name!r} failed to load from entry point {entry.value!r} "
                f"({type(exc).__name__}: {exc}); reinstall the package (pip install -e .)"
            ) from exc
        if not isinstance(command, click.Command):
            raise click.ClickException(f"entry point {entry.value!r} of command {name!r} is "
                                       f"not a click command ({type(command).__name__})")
        return command
