"""What a declared setting is and how a value becomes one: its field, names and coercion.

A section's field is declared with :func:`setting` (or a plain default); its flat name is the
section's prefix + the field's name, its variable ``DFLASH_`` + the flat name in capitals. A
variable's text is coerced to the field's type here, so a bad value names its variable.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import Field, field, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from common.declared import OPT, Opt
from common.errors import ConfigError

ENV_PREFIX = "DFLASH_"
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
DEVICES = "auto, cpu, cuda, cuda:N or mps"
"""What a device setting accepts (checked at load, so a typo names its variable)."""
# A URL's userinfo runs to the last "@" before the host: a password may hold a raw "@" (or ":").
_USERINFO = re.compile(r"(?<=://)([^\s'\"<>@]*@)+")


def mask_url(url: str) -> str:
    """Hide the whole password of each URL in ``url`` (``redis://:secret@host:6379/0``; a raw
    ``@`` in it too) for logs and repr: the user name stays, a userinfo without one is hidden."""
    def hide(match: re.Match[str]) -> str:
        user, colon, _ = match.group(0)[:-1].partition(":")
        return f"{user}:***@" if colon else "***@"

    return _USERINFO.sub(hide, url)


SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")
"""SGLang's flags whose value is a secret: hidden wherever a command line is shown."""
_SECRET_VALUE = re.compile(rf"({'|'.join(map(re.escape, SECRET_FLAGS))})(=|\s+)(\S+)")


def mask_flags(line: str) -> str:
    """Hide the values of :data:`SECRET_FLAGS` in a command line held as text (an engine
    command or extra flags in a setting) for logs and repr."""
    return _SECRET_VALUE.sub(r"\1\2***", line)


def default_cache_dir() -> Path:
    """Where built artefacts (the tiny CPU model) live unless the cache_dir setting says so."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-pipeline"


def env_name(name: str) -> str:
    """The environment variable of a field's flat name: ``DFLASH_`` + the name in capitals."""
    return ENV_PREFIX + name.upper()


def setting(default: Any, *, flat: str = "", zero_ok: bool = False, secret: bool = False,
            device: bool = False, below: float | None = None, help: str = "",  # noqa: A002
            commands: tuple[str, ...] = (), decls: tuple[str, ...] = (),
            at: Mapping[str, Mapping[str, Any]] | None = None, **click_kw: Any) -> Any:
    """A declared field: ``flat`` replaces prefix + name (a variable older than its section),
    ``zero_ok`` lets a number be 0 (off, the default, or an index), ``secret`` hides it in repr,
    ``device`` checks it against :data:`DEVICE` (a choice's values are its enum's), ``below``
    bounds a number from above (exclusive); ``help``, ``commands``, ``decls``, ``at`` and
    click's keywords make it an option of those commands (:class:`common.declared.Opt`)."""
    meta = {"flat": flat, "zero_ok": zero_ok, "secret": secret, "device": device,
            "below": below,
            OPT: Opt(help, decls, commands, True, MappingProxyType(click_kw),
                     MappingProxyType(dict(at or {})))}
    return field(default=default, metadata=meta)


def section_fields(section: type) -> Iterator[tuple[str, Field[Any]]]:
    """(flat name, field) of each field a section declares."""
    prefix = getattr(section, "PREFIX", "")
    for f in fields(section):
        yield (f.metadata.get("flat") or prefix + f.name), f


def as_field(value: Any, f: Field[Any]) -> Any:
    """A choice given as its text (a keyword, ``replace``) as its enum's member; a number that
    is not finite refused (a click ``FloatRange`` lets NaN through, which no bound stops)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{f.name}={value!r} is not a finite number")
    return type(f.default)(value) if isinstance(f.default, Enum) else value


def coerce(name: str, raw: str, f: Field[Any]) -> object:
    """A variable's text as its field's type; the error is one line naming the variable."""
    kind: Any = type(f.default)
    if issubclass(kind, Enum):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{env_name(name)}={raw!r} is not one of "
                              f"{', '.join(member.value for member in kind)}") from None
    try:
        value = kind(raw) if kind is not Path else Path(raw).expanduser()
    except ValueError as exc:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {kind.__name__}") from exc
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):   # NaN compares false to bounds
        raise ConfigError(f"{env_name(name)}={raw!r} is not a finite number")
    if isinstance(value, int | float) and (value < 0 or (value == 0 and not meta.get("zero_ok"))):
        raise ConfigError(f"{env_name(name)}={raw!r} must be positive")
    if meta.get("below") is not None and not value < meta["below"]:   # NaN too
        raise ConfigError(f"{env_name(name)}={raw!r} must be below {meta['below']}")
    if meta.get("device") and not DEVICE.fullmatch(str(value)):
        raise ConfigError(f"{env_name(name)}={raw!r} is not a device: {DEVICES}")
    return value
