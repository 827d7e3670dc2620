"""CLI plumbing every command shares, producer's and the stages' alike: options derived from the
declared settings and per-command options (their defaults and ``DFLASH_*`` variables), the
``--storage``, ``--broker-url`` and ``-v`` options, logging, and the mapping of errors to one
line and an exit code (0 success, 1 failure, 2 bad usage, 3 rejected input rows, 4 run config
mismatch).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import MISSING
from enum import Enum
from typing import Any, TypeVar

import click

from common.cli.options import OPTIONS
from common.config import FIELDS, env_name, load_settings, mask_url
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
from common.runs.options import run_option_fields

log = logging.getLogger("dflash")
F = TypeVar("F", bound=Callable[..., Any])


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Our own progress lines (long enqueues) show by default; libraries stay quiet.
    logging.getLogger("producer").setLevel(logging.INFO)


def setting_option(name: str, *decls: str, **kw: Any) -> Callable[[F], F]:
    """A click option for the setting ``name`` (a flat name): its variable and shown default come
    from :class:`common.config.Settings`; unset (None) means "as the settings say"."""
    default = FIELDS[name][1].default
    kw.setdefault("show_default", mask_url(str(default.value if isinstance(default, Enum)
                                               else default)))
    return click.option(*_decls(name, decls), default=None, envvar=env_name(name),
                        show_envvar=True, **kw)


def command_option(name: str, *decls: str, **kw: Any) -> Callable[[F], F]:
    """A click option declared in :mod:`common.cli.options`: its default and variable come from
    there (shown unless it is None or off); ``decls`` may name the parameter (``"as_json"``)."""
    default = OPTIONS[name].default
    default = None if default is MISSING else default   # a required option declares none
    default = default.value if isinstance(default, Enum) else default   # click shows the text
    if default is not False and not (default is None and kw.get("required")):
        kw["default"] = default   # a flag's off and a required option's none stay click's own
        if default is not None:
            kw.setdefault("show_default", True)
    return click.option(*_decls(name, decls), envvar=env_name(name), show_envvar=True, **kw)


def run_click_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Every declared run option (:mod:`common.runs.options`) as a click option, in order."""
    for f in reversed(run_option_fields()):
        meta = f.metadata
        func = command_option(f.name, *meta["decls"], help=meta["help"], **meta["click"])(func)
    return func


def engine_launch_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """How an SGLang server is launched, the same for the generate worker and ``bench --run``."""
    options = [
        setting_option("engine_cmd", help="Replace the engine launch command; {port}, {model}, "
                                          "{gpu}, {tp} are filled in, and {engine_args}: the "
                                          "flags the worker would pass SGLang (MTP's, "
                                          "--engine-args, --max-running-requests) (empty: "
                                          "python -m sglang.launch_server ...)."),
        setting_option("engine_args", help="Extra SGLang launch flags; a "
                                           "--speculative-algorithm here wins over --mtp (other "
                                           "--speculative-* flags tune MTP's)."),
        setting_option("engine_python",
                       help="Python that runs `-m sglang.launch_server` (SGLang in a venv of its "
                            "own, e.g. .venv-sglang/bin/python) [default: the worker's own "
                            "python]."),
        setting_option("tp", type=click.IntRange(min=1),
                       help="Tensor-parallel size of the engine server; with --gpu G it gets "
                            "GPUs G..G+tp-1 (CUDA_VISIBLE_DEVICES)."),
        setting_option("mem_fraction_static", help="SGLang --mem-fraction-static."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _decls(name: str, decls: tuple[str, ...]) -> tuple[str, ...]:
    """``--the-name`` unless given, and the parameter ``name`` unless a declaration names one."""
    decls = decls or (f"--{name.replace('_', '-')}",)
    return decls if any(d.isidentifier() for d in decls) else (*decls, name)


def common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--storage and --broker-url, shared by every command that touches the run."""

    @setting_option("storage", help="Storage root: s3://bucket/prefix or a local directory.")
    @setting_option("broker_url", help="Redis URL of the Celery broker.")
    @command_option("verbose", "-v", "--verbose", is_flag=True, help="Log progress to stderr.")
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
