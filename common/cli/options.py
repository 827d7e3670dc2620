"""Per-command options declared once, in sections like the settings, each field one
:func:`common.declared.opt`: its default, help, flags and the commands that take it, and (where
``env``) its ``DFLASH_*`` variable derived from its flat name.

These are read by click for the commands that take them (a run id, a report flag), never by
:func:`common.config.load_settings`; a run's own options (what ``enqueue`` freezes into run.json)
are declared in :mod:`common.runs.options`, a command's own beside it (``BenchOptions``).
"""

from __future__ import annotations

from dataclasses import Field, dataclass
from pathlib import Path
from typing import Any, ClassVar

import click

from common.choices import Stage
from common.config import section_fields
from common.declared import declared, opt
from common.runs.options import RunOptions

JSON_COMMANDS = ("enqueue", "resume", "status", "plan-storage", "plan-training", "bench",
                 "export-dataset", "export-drafter", "eval-drafter", "doctor", "serve-command")


@dataclass(frozen=True)
class CliOptions:
    """What every command takes (``-v``; ``--storage`` and ``--broker-url`` are settings), and
    ``--json`` of the commands that print a record."""

    verbose: bool = opt(False, decls=("-v", "--verbose"), commands=("*",), env=True,
                        is_flag=True, help="Log progress to stderr.")
    as_json: bool = opt(False, decls=("--json",), commands=JSON_COMMANDS, is_flag=True,
                        at={"status": {"help": "Print one JSON object (per refresh)."}},
                        help="Print the result as one JSON object.")


@dataclass(frozen=True)
class ReportOptions:
    """``report``: how it prints and where its figure goes."""

    PREFIX: ClassVar[str] = "report_"
    json: bool = opt(False, decls=("--json", "as_json"), commands=("report",), env=True,
                     is_flag=True, help="Print the report as one JSON object.")
    png: Path | None = opt(
        None, decls=("--png", "png_path"), commands=("report",), env=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="Also write the PNG figure to this local file (its only copy when the storage "
             "refuses the write, as for a read-only key).")
    no_png: bool = opt(False, decls=("--no-png", "no_png"), commands=("report",), env=True,
                       is_flag=True, help="Do not render or store the PNG figure.")


@dataclass(frozen=True)
class UiOptions:
    """``ui``: where the dashboard listens (its auth is the ``ui_auth`` setting)."""

    PREFIX: ClassVar[str] = "ui_"
    host: str = opt("127.0.0.1", decls=("--host", "host"), commands=("ui",), env=True,
                    help="Address to listen on; anything but loopback needs DFLASH_UI_AUTH.")
    port: int = opt(8700, decls=("--port", "port"), commands=("ui",), env=True,
                    type=click.IntRange(1, 65535), help="Port to listen on.")


@dataclass(frozen=True)
class WorkerOptions:
    """``worker generate|hidden|train``: the Celery process itself."""

    loglevel: str = opt("INFO", env=True, help="Celery log level.",
                        commands=("worker generate", "worker hidden", "worker train"))
    worker_name: str | None = opt(
        None, decls=("--name", "name"), env=True, help="Worker node name.",
        at={f"worker {queue}": {"help": f"Worker node name [default: {queue}-gpuN@host or "
                                        f"{queue}-cpu@host]."}
            for queue in Stage})
    concurrency: int | None = opt(   # unset: 2 shards with SGLang, 1 with the CPU engine
        None, env=True, commands=("worker generate",), type=click.IntRange(min=1),
        help="Shards held at once (they share one engine) [default: 2 with --engine sglang, so "
             "the next shard fills the engine while one drains; 1 with the CPU engine].")


SECTIONS: tuple[type, ...] = (CliOptions, RunOptions, ReportOptions, UiOptions, WorkerOptions)
OPTIONS: dict[str, Field[Any]] = {
    flat: f for section in SECTIONS for flat, f in section_fields(section)
    if (found := declared(f)) is None or found.env
}
"""Every per-command option with a variable, by flat name (its variable is ``env_name(flat)``)."""
