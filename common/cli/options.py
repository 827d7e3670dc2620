"""Per-command options declared once, in sections like the settings: each field's default here,
its ``DFLASH_*`` variable derived from its flat name (:func:`common.cli.command_option`).

These are read by click for the one command that takes them (a run id, a report flag), never by
:func:`common.config.load_settings`; a run's own options (what ``enqueue`` freezes into run.json)
are declared in :mod:`common.runs.options`.
"""

from __future__ import annotations

from dataclasses import Field, dataclass
from typing import Any, ClassVar

from common.config import section_fields
from common.runs.options import RunOptions


@dataclass(frozen=True)
class CliOptions:
    """What every command takes."""

    verbose: bool = False


@dataclass(frozen=True)
class ReportOptions:
    """``report``: how it prints and where its figure goes."""

    PREFIX: ClassVar[str] = "report_"
    json: bool = False
    png: str | None = None
    no_png: bool = False


@dataclass(frozen=True)
class UiOptions:
    """``ui``: where the dashboard listens (its auth is the ``ui_auth`` setting)."""

    PREFIX: ClassVar[str] = "ui_"
    host: str = "127.0.0.1"
    port: int = 8700


@dataclass(frozen=True)
class WorkerOptions:
    """``worker generate|hidden|train``: the Celery process itself."""

    loglevel: str = "INFO"
    worker_name: str | None = None
    concurrency: int | None = None   # unset: 2 shards with SGLang, 1 with the CPU engine


SECTIONS: tuple[type, ...] = (CliOptions, RunOptions, ReportOptions, UiOptions, WorkerOptions)
OPTIONS: dict[str, Field[Any]] = {
    flat: f for section in SECTIONS for flat, f in section_fields(section)
}
"""Every per-command option by flat name (its variable is ``env_name(flat)``)."""
