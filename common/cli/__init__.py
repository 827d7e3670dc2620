"""CLI plumbing every command shares, producer's and the stages' alike: each command's click
options made from the declarations that name it (:func:`options_for`: settings, run options,
per-command options; their defaults, help and ``DFLASH_*`` variables), the ``--storage``,
``--broker-url`` and ``-v`` options, logging, and the mapping of errors to one
line and an exit code (0 success, 1 failure, 2 bad usage, 3 rejected input rows, 4 run config
mismatch).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field
from enum import Enum, StrEnum
from typing import Any, TypeVar

import click

from common.choices import EnumChoice
from common.cli.options import SECTIONS as SHARED
from common.config import SECTIONS as SETTING_SECTIONS
from common.config import env_name, load_settings, mask_url, section_fields
from common.declared import Opt, declared
from common.errors import (
    ConfigError,
    DflashError,
    InputError,
    NotFound,
    OptionRefused,
    RunConfigMismatch,
)
from common.exit_codes import EXIT_FAILURE, EXIT_MISMATCH, EXIT_USAGE
from common.runs.options import FiniteRange as FiniteRange  # noqa: F401 - for the commands

log = logging.getLogger("dflash")
F = TypeVar("F", bound=Callable[..., Any])


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Our own progress lines (long enqueues) show by default; libraries stay quiet.
    logging.getLogger("producer").setLevel(logging.INFO)


COMMON = "*"
"""The command name of the options every command that touches the run takes
(:func:`common_options`): ``--storage``, ``--broker-url``, ``-v``."""
_SECTIONS: list[type] = []   # the commands' own sections, as options_for met them


def options_for(command: str, *sections: type) -> Callable[[F], F]:
    """Every declared option ``command`` takes (its path: ``"worker train"``) as click options,
    in order: the run options, the command's own ``sections``, the settings, the shared ones."""
    for section in sections:
        if section not in _SECTIONS:
            _SECTIONS.append(section)

    def apply(func: F) -> F:
        for option in reversed([_option(*found, command) for found in _declared(sections)
                                if found[2].takes(command)]):
            func = option(func)
        return func

    return apply


def command_sections() -> list[type]:
    """The per-command sections declared beside their commands (those loaded so far)."""
    return list(_SECTIONS)


def _declared(sections: tuple[type, ...]) -> Iterator[tuple[str, Field[Any], Opt, bool]]:
    """(flat name, field, declaration, whether a setting) of every declared option."""
    from common.runs.options import RunOptions

    settings = tuple(SETTING_SECTIONS.values())
    for section in dict.fromkeys((RunOptions, *sections, *settings, *SHARED)):
        setting = section in settings
        for flat, f in section_fields(section):
            found = declared(f)
            if found is not None:
                yield flat, f, found, setting


def _option(flat: str, f: Field[Any], found: Opt, setting: bool,
            command: str) -> Callable[[F], F]:
    """One declared option as ``command``'s click option: a setting unset (None) means "as the
    settings say", shown with their default; another shows its own default."""
    kw: dict[str, Any] = {"help": found.help, **found.click, **found.at.get(command, {})}
    if found.env:
        kw.setdefault("envvar", env_name(flat))
        kw.setdefault("show_envvar", kw["envvar"] is not None)
    default = None if f.default is MISSING else f.default
    shown = default.value if isinstance(default, Enum) else default   # click shows the text
    if setting:
        kw.setdefault("show_default", mask_url(str(shown)))
        kw.setdefault("default", None)
        if "flag_value" not in kw:
            kw.setdefault("type", _setting_type(f))
    elif "default" not in kw and shown is not False and not (shown is None and kw.get("required")):
        kw["default"] = shown   # a flag's off and a required option's none stay click's own
        if shown is not None:
            kw.setdefault("show_default", True)
    return click.option(*_decls(flat, found.decls), **kw)


def _setting_type(f: Field[Any]) -> click.ParamType[Any] | None:
    """A setting's click type from its declaration: a number's bounds, a choice's members."""
    meta, default = f.metadata, f.default
    if isinstance(default, StrEnum):
        return EnumChoice(type(default))
    if isinstance(default, bool) or not isinstance(default, int | float):
        return None
    low = 0 if meta.get("zero_ok") else 1
    if isinstance(default, int):
        return click.IntRange(min=low)
    below = meta.get("below")
    below = int(below) if isinstance(below, float) and below.is_integer() else below
    return FiniteRange(min=0, max=below, min_open=low != 0, max_open=below is not None)


def _decls(name: str, decls: tuple[str, ...]) -> tuple[str, ...]:
    """``--the-name`` unless given, and the parameter ``name`` unless a declaration names one."""
    decls = decls or (f"--{name.replace('_', '-')}",)
    return decls if any(d.isidentifier() for d in decls) else (*decls, name)


def common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--storage and --broker-url, shared by every command that touches the run."""

    @options_for(COMMON)
    @functools.wraps(func)
    def wrapper(storage: str | None, broker_url: str | None, verbose: bool, **kw: Any) -> Any:
        import redis
        from kombu.exceptions import OperationalError

        setup_logging(verbose)
        try:
            settings = load_settings(storage=storage, broker_url=broker_url)
        except ConfigError as exc:  # a bad DFLASH_* value: one line naming the variable
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILURE)
        try:
            return func(settings=settings, **kw)
        except (redis.RedisError, OperationalError) as exc:
            # Redis went away after start-up (the start-up check names it too).
            click.echo(f"error: lost Redis at {settings.masked_broker_url}: "
                       f"{mask_url(str(exc)).splitlines()[0] if str(exc) else type(exc).__name__}"
                       "; nothing is lost, run the command again once Redis is back", err=True)
            sys.exit(EXIT_FAILURE)
        except RunConfigMismatch as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_MISMATCH)
        except OptionRefused as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except (ConfigError, InputError, NotFound) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILURE)
        except DflashError as exc:
            click.echo(f"error: {type(exc).__name__}: {exc}", err=True)
            sys.exit(EXIT_FAILURE)
        except OSError as exc:
            click.echo(f"error: {exc} (broker {settings.masked_broker_url}, storage "
                       f"{settings.broker.storage})", err=True)
            sys.exit(EXIT_FAILURE)

    return wrapper
