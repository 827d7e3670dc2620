"""One option's declaration, the same form for a setting, a run option and a per-command option.

A dataclass field carries an :class:`Opt` in its metadata: its ``--help`` text, flag names,
click's keywords (its type, a flag), whether a ``DFLASH_*`` variable sets it, and the commands
that take it. :func:`common.cli.options_for` makes a command's click options from these, and the
settings reference and run.json's schema read them; nothing else restates an option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field
from types import MappingProxyType
from typing import Any

OPT = "opt"
"""The metadata key of a field's :class:`Opt`."""
_MISSING: Any = MISSING
_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Opt:
    """How one field is an option: ``at`` holds click keywords for one command where it reads
    differently there (``{"bench": {"required": False}}``, a command's own ``help``)."""

    help: str = ""
    decls: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()
    env: bool = True
    click: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    at: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _EMPTY)

    def takes(self, command: str) -> bool:
        """Whether ``command`` (its path: ``"worker train"``) takes this option."""
        return command in self.commands or command in self.at


def opt(default: Any = _MISSING, *, help: str,  # noqa: A002 - click's own word
        decls: tuple[str, ...] = (), commands: tuple[str, ...] = (), env: bool = False,
        at: Mapping[str, Mapping[str, Any]] | None = None, **click_kw: Any) -> Any:
    """A declared per-command option (no default: a required one); ``env`` gives it the
    ``DFLASH_*`` variable of its flat name; ``click_kw`` are click's (``type``, ``is_flag``)."""
    meta = {OPT: Opt(help, decls, commands, env, MappingProxyType(click_kw),
                     MappingProxyType(dict(at or {})))}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


def declared(f: Field[Any]) -> Opt | None:
    """The field's declaration as an option, None for a field no command takes."""
    found = f.metadata.get(OPT)
    return found if isinstance(found, Opt) else None
