"""``dflash-pipeline bench``: an engine's throughput, on synthetic prompts or a run's own.

    dflash-pipeline bench --engine-url http://127.0.0.1:30000 --concurrency 16,64,256
    dflash-pipeline bench --run qwen36 --engine sglang --gpu 0 --concurrency 32,128 --gpus 8

With ``--run`` the engine is started as the worker starts it, once per ``--mtp`` configuration,
and the table ends with the run's projected hours per configuration (:mod:`producer.bench_run`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from common.cli import options_for
from common.config import Settings
from common.declared import opt
from common.errors import DflashError, OptionRefused
from common.exit_codes import EXIT_FAILURE

DEFAULT_LEVELS, DEFAULT_PROMPT_LEN, DEFAULT_MAX_NEW = "16,64,256", 256, 512
MODES = ("off", "on")


def _levels(concurrency: str | None, in_flight: int) -> list[int]:
    """The concurrencies to measure: ``--concurrency``'s, else the defaults and the worker's own
    ``--max-in-flight``."""
    if concurrency is None:
        return sorted({*(int(c) for c in DEFAULT_LEVELS.split(",")), in_flight})
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"{concurrency!r} is not a comma-separated list of integers",
                                 param_hint="--concurrency") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("give at least one positive concurrency",
                                 param_hint="--concurrency")
    return levels


def _modes(value: str | None) -> list[str] | None:
    if value is None:
        return None
    modes = [m.strip() for m in value.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) < len(modes):
        raise click.BadParameter(f"{value!r}: give off, on or off,on", param_hint="--mtp")
    return modes


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """``bench``'s own options."""

    concurrency: str | None = opt(
        None, commands=("bench",),
        help="Comma-separated numbers of requests kept in flight [default: "
             f"{DEFAULT_LEVELS} and --max-in-flight].")
    num: int = opt(
        256, commands=("bench",), type=click.IntRange(min=1),
        help="Requests per concurrency level (--run: prompts drawn from the run).")
    prompt_len: int | None = opt(
        None, commands=("bench",), type=click.IntRange(min=1),
        help=f"Prompt tokens per synthetic request [default: {DEFAULT_PROMPT_LEN}; "
             "--run: the run's own].")
    max_new_tokens: int | None = opt(
        None, commands=("bench",), type=click.IntRange(min=1),
        help=f"Generation budget per synthetic request [default: {DEFAULT_MAX_NEW}; "
             "--run: the run's own].")
    mtp_modes: str | None = opt(
        None, decls=("--mtp",), commands=("bench",),
        help="--run: configurations to measure, off, on or off,on [default: off,on "
             "where the target states an MTP head that keeps the run's sampling, "
             "else off].")
    gpus: int = opt(
        1, commands=("bench",), type=click.IntRange(min=1),
        help="--run: GPUs the projection divides the run over (engines: gpus / tp).")
    gpu: int | None = opt(
        None, commands=("bench",), type=click.IntRange(min=0),
        help="--run: first GPU of the engine (CUDA_VISIBLE_DEVICES) [unset: as "
             "visible].")


def bench(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]) -> click.Command:
    """The ``bench`` command, wrapped in the CLI's shared options."""

    @click.command("bench")
    @options_for("bench", BenchOptions)
    @common_options
    def command(settings: Settings, run: str | None, engine_url: str | None,
                concurrency: str | None,
                num: int, prompt_len: int | None, max_new_tokens: int | None,
                mtp_modes: str | None, gpus: int, model: str | None, gpu: int | None,
                as_json: bool, **overrides: Any) -> None:
        """Measure output tokens/s, requests/s, latency and accept length at several
        concurrencies; with --run, on the run's own prompts, with MTP off and on, and project
        the run's hours."""
        settings = settings.replace(**{k: v for k, v in overrides.items() if v is not None})
        levels = _levels(concurrency, settings.generate.max_in_flight)
        modes = _modes(mtp_modes)
        if run is None:
            _synthetic(engine_url, levels, num, prompt_len or DEFAULT_PROMPT_LEN,
                       max_new_tokens or DEFAULT_MAX_NEW, mtp_modes, as_json)
            return
        for given, name in ((prompt_len, "--prompt-len"), (max_new_tokens, "--max-new-tokens")):
            if given is not None:
                raise OptionRefused(f"{name} is for synthetic prompts; --run asks with the "
                                    "run's own")
        settings = settings.replace(engine_url=engine_url or "")
        if gpus < settings.generate.tp:
            raise OptionRefused(f"--gpus {gpus} holds no engine of --tp {settings.generate.tp}")
        from producer.bench_run import bench_run
        from producer.projection import render_projection

        result = bench_run(settings, run, modes, levels, num, gpus, model, gpu)
        if as_json:
            click.echo(json.dumps({"rows": [r.to_json() for r in result.rows],
                                   "projection": result.projection.to_json(),
                                   "verdict": {"key": result.verdict, "note": result.note}},
                                  sort_keys=True))
        else:
            from producer.bench import render_table

            click.echo(render_table(result.rows) + "\n" + render_projection(result.projection)
                       + f"\nverdict: {result.verdict or '-'} ({result.note})")

    return command


def _synthetic(engine_url: str | None, levels: list[int], num: int, prompt_len: int,
               max_new_tokens: int, mtp_modes: str | None, as_json: bool) -> None:
    """The bench of a running server on synthetic prompts (no run)."""
    from producer.bench import render_table, run_bench

    if not engine_url:
        raise click.UsageError("give --engine-url (a running server), or --run RUN")
    if mtp_modes is not None:
        raise click.UsageError("--mtp needs --run (the bench starts the engine per "
                               "configuration)")
    try:
        rows = run_bench(engine_url, levels, num, prompt_len, max_new_tokens)
    except DflashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    if as_json:
        best = max(rows, key=lambda r: r.tokens_per_s)
        click.echo(json.dumps({"rows": [r.to_json() for r in rows],
                               "best_concurrency": best.concurrency}, sort_keys=True))
    else:
        click.echo(render_table(rows))
