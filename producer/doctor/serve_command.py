"""``dflash-pipeline serve-command``: the SGLang launch line for MTP generation or DFLASH serving.

    dflash-pipeline serve-command mtp --model /models/Qwen3.6-27B      # generate with its MTP head
    dflash-pipeline serve-command dflash --model /models/Qwen3.6-27B --drafter out/drafter
    dflash-pipeline serve-command dflash --drafter out/drafter --json

Prints the ``python -m sglang.launch_server ...`` line and the ``DFLASH_ENGINE_ARGS`` value that
makes a generate worker start the same engine. ``--json`` prints ``{"kind", "argv", "command",
"engine_args", "warnings"}``. Built by :mod:`common.engine.serving` from the target's
``config.json`` (:class:`common.engine.target.TargetShape`); nothing is launched and SGLang need
not be installed.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from common.cli import options_for
from common.config import Settings
from common.declared import opt
from common.errors import ConfigError
from common.exit_codes import EXIT_FAILURE

KINDS = ("mtp", "dflash")


def drafter_block_size(drafter: Path) -> int:
    """The block size an ``export-drafter`` directory records (its verify window)."""
    try:
        config = json.loads((drafter / "config.json").read_text())
        dflash = config.get("dflash_config") or {}
        return int(dflash.get("block_size", config["block_size"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{drafter} is not a drafter export ({exc!r}); make one with "
                          "`dflash-pipeline export-drafter --run RUN --out DIR`") from None


def build(settings: Settings, kind: str, drafter: Path | None, max_running_requests: int,
          host: str = "127.0.0.1") -> dict[str, Any]:
    """The launch line of ``kind`` for the configured target, with doctor's mamba warning."""
    from common.engine.serving import (
        dflash_engine_args,
        launch_argv,
        mtp_engine_args,
        shell_line,
    )
    from common.engine.target import TargetShape
    from producer.doctor.gpu_host import check_mamba_cache
    from producer.doctor.target import target_dir

    path, present = target_dir(settings)
    if not present:
        raise ConfigError(f"target {path} is not there: the line is built from its config.json "
                          "(download it and pass --model DIR / DFLASH_MODEL)")
    shape = TargetShape.from_dir(path)
    if kind == "mtp":
        try:
            engine_args = mtp_engine_args(shape, max_running_requests=max_running_requests)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    else:
        if drafter is None:
            raise ConfigError("serve-command dflash needs --drafter DIR (an export-drafter "
                              "directory)")
        engine_args = dflash_engine_args(drafter.resolve(), block_size=drafter_block_size(drafter),
                                         max_running_requests=max_running_requests)
    argv = launch_argv(path, host=host, port=settings.generate.engine_port, tp=settings.generate.tp,
                       mem_fraction_static=settings.generate.mem_fraction_static,
                       engine_args=engine_args, python="python")
    block = drafter_block_size(drafter) if drafter is not None else None
    mamba = check_mamba_cache(shape, shell_line(engine_args), max_running_requests, block)
    warnings = [f"{mamba.detail}; fix: {mamba.fix}"] if mamba is not None and mamba.warn else []
    return {"kind": kind, "argv": argv, "command": shell_line(argv),
            "engine_args": shell_line(engine_args), "warnings": warnings}


@dataclass(frozen=True, kw_only=True)
class ServeCommandOptions:
    """``serve-command``'s own options."""

    drafter: Path | None = opt(
        None, commands=("serve-command",), type=click.Path(path_type=Path, file_okay=False),
        help="The export-drafter directory to serve (dflash).")
    max_running_requests: int | None = opt(
        None, commands=("serve-command",), type=click.IntRange(min=1),
        help="Requests SGLang runs at once (a speculative server runs 48 "
             "otherwise; SGLang sizes its pools for them) "
             "[default: DFLASH_MAX_IN_FLIGHT].")
    host: str = opt(
        "127.0.0.1", commands=("serve-command",),
        help="Address SGLang listens on (0.0.0.0 to serve other hosts).")


def serve_command_command(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                          ) -> click.Command:
    """The ``serve-command`` command, wrapped in the CLI's shared options."""

    @click.command("serve-command")
    @click.argument("kind", type=click.Choice(KINDS))
    @options_for("serve-command", ServeCommandOptions)
    @common_options
    def serve_command(settings: Settings, kind: str, model: str | None, drafter: Path | None,
                      max_running_requests: int | None, host: str, as_json: bool) -> None:
        """Print the SGLang launch line: generation with the target's MTP head, or DFLASH."""
        if model:
            settings = settings.replace(model=model)
        try:
            result = build(settings, kind, drafter,
                           max_running_requests or settings.generate.max_in_flight, host)
        except ConfigError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILURE)
        if as_json:
            click.echo(json.dumps(result, sort_keys=True))
            return
        click.echo(result["command"])
        click.echo("# a generate worker starts the same engine with DFLASH_ENGINE=sglang "
                   f"DFLASH_ENGINE_ARGS={shlex.quote(result['engine_args'])}")
        for warning in result["warnings"]:
            click.echo(f"# warning: {warning}")

    return serve_command
