"""The whole ``dflash-pipeline`` group for mkdocs-click, the stages' entry-point commands loaded.

mkdocs-click lists a group's ``commands`` when it has any, so the commands that join the group
through package entry points (``worker``, ``export-drafter``, ``eval-drafter``) would be left
out; this copy of the group holds every command ``--help`` lists, resolved the way the CLI
resolves them, and nothing else.
"""

from __future__ import annotations

import copy
import inspect

import click

from producer.cli import main


def loaded(group: click.Group, ctx: click.Context) -> click.Group:
    """A shallow copy of ``group`` whose ``commands`` are all it lists, sub-groups likewise."""
    commands: dict[str, click.Command] = {}
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None:
            continue
        if isinstance(command, click.Group):
            command = loaded(command, click.Context(command, info_name=name, parent=ctx))
        commands[name] = command
    whole = copy.copy(group)
    whole.commands = commands
    return whole


cli = loaded(main, click.Context(main, info_name="dflash-pipeline"))


def summaries(group: click.Group = cli, prefix: str = "") -> dict[str, str]:
    """Each command's path and the first paragraph of its help, sub-commands in place of their
    group: the README's table of commands (tests/test_docs.py holds it to this)."""
    found: dict[str, str] = {}
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            found.update(summaries(command, f"{path} "))
        else:
            first = inspect.cleandoc(command.help or "").split("\n\n")[0]
            found[path] = " ".join(first.split())
    return found
