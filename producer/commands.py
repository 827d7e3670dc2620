"""What the CLI commands do beyond parsing options: build configs, print reports and status."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import click
import redis

from common import keys
from common.choices import OriginKind, RunState
from common.config import Settings
from common.drafter.layers import DEFAULT_K
from common.drafter.origin import DrafterSummary, drafter_summary
from common.engine.models import chat_template_of, resolve_model_path, template_sha
from common.engine.sampling import Sampling
from common.engine.sampling_rules import check_sampling
from common.engine.target import TargetShape
from common.engine.target_sampling import resolve_max_new_tokens, resolve_sampling, sampling_line
from common.engine.thinking import parse_thinking
from common.errors import ConfigError, InputError
from common.inputs.sources import is_glob
from common.inputs.templates import template_fields
from common.queue.celery_app import TRAIN
from common.queue.redis_values import count_of, field_key
from common.runs.options import RunOptions, as_given
from common.runs.records import RunConfig
from common.storage import Storage
from producer.enqueue import EnqueueReport
from producer.enqueue_drafter import enqueue_origin
from producer.fit import ContextCheck, context_length
from producer.pause_lines import pause_lines
from producer.status import StatusReader
from producer.status_record import GateCounts, RunStatus
from producer.status_rules import epoch_hours_line

log = logging.getLogger(__name__)


def build_run_config(settings: Settings, options: RunOptions) -> RunConfig:
    """Validate the options and freeze them, with the model's chat template fingerprint;
    sampling an option leaves unset comes from the target's generation_config.json."""
    if not keys.valid_run_id(options.run):
        raise ConfigError(f"invalid run id {options.run!r}: use 1-128 letters, digits, '.', "
                          "'_' or '-'")
    if options.prompt_template is not None and not template_fields(options.prompt_template):
        raise ConfigError(f"--prompt-template {options.prompt_template!r} names no field; use "
                          "{field} placeholders, e.g. '{instruction}\\n\\n{context}'")
    sources = [input_source(spec) for spec in options.input]
    if settings.model_is_tiny:
        click.echo("Preparing the embedded CPU model (built once, then cached)...", err=True)
    model_dir = resolve_model_path(settings)
    sampling, sampling_sources = run_sampling(model_dir, options)
    template = chat_template_of(model_dir)
    if template is None:
        raise ConfigError(f"model {settings.target.model!r} has no chat template")
    # eagle3 keeps its fixed layers; dflash freezes the ids resolved for this target, or the
    # drafter config's, and the drafter's shape with them (checked against the target here).
    target = TargetShape.from_dir(model_dir)
    drafter, layer_ids = enqueue_origin(options, target)
    if drafter and drafter.kind == OriginKind.INIT:
        from producer.released import check_released_weights

        check_released_weights(drafter, target, layer_ids)
    return RunConfig(
        **as_given(options), model=settings.target.model,
        input=sources[0] if len(sources) == 1 else sources, sampling=sampling,
        gates=options.gates(), target_layers=len(layer_ids) if layer_ids else DEFAULT_K,
        target_layer_ids=layer_ids, chat_template_sha=template_sha(template),
        chat_template_kwargs=dict(options.chat_template_kwargs or {}),
        sampling_sources=sampling_sources, drafter=drafter,
    )


def run_sampling(model_dir: Any, options: RunOptions) -> tuple[Sampling, dict[str, str]]:
    """The run's sampling (options over the target's generation_config.json over defaults) and
    where each value came from."""
    values, sources = resolve_sampling(model_dir, {
        name: getattr(options, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                  "repetition_penalty", "presence_penalty")})
    max_new, sources["max_new_tokens"] = resolve_max_new_tokens(options.max_new_tokens,
                                                                context_length(model_dir))
    try:
        think, off_share = parse_thinking(options.thinking_mode)
    except ValueError as exc:
        raise ConfigError(f"--thinking: {exc}") from None
    sampling = Sampling(max_new_tokens=max_new, thinking=think, thinking_off_share=off_share,
                        **values)
    check_sampling(sampling)
    return sampling, sources


def input_source(spec: str) -> str:
    """An ``--input`` as run.json keeps it: absolute for local paths; must exist unless a glob."""
    if not spec:
        raise InputError("empty --input")
    if spec.startswith("s3://"):
        return spec
    if not is_glob(spec) and not os.path.exists(spec):
        raise InputError(f"input not found: {spec}")
    return os.path.abspath(spec)


def context_check(settings: Settings, config: RunConfig) -> ContextCheck | None:
    """The enqueue-time context check for the run's model (None if its context is unknown)."""
    model_settings = settings.replace(model=config.model)
    return ContextCheck.for_model(resolve_model_path(model_settings),
                                  config.gates.min_answer_tokens, config.sampling,
                                  config.chat_template_kwargs)


def sampling_in_force(config: RunConfig) -> dict[str, Any]:
    """Each sampling value of the run and where it came from (``--json``'s ``sampling``)."""
    from dataclasses import asdict

    sources = config.sampling_sources
    return {name: {"value": value, "source": sources.get(name, "option")}
            for name, value in asdict(config.sampling).items()}


def drafter_in_force(config: RunConfig) -> DrafterSummary | None:
    """The run's frozen drafter shape source and target layers (``--json``'s ``drafter``)."""
    return drafter_summary(config.drafter, config.target_layer_ids)


def _turn_line(gates: GateCounts) -> str:
    """Turns judged and rejected, and the thinking modes, when the monitor counted them."""
    turns, modes = gates.get("turns"), gates.get("thinking")
    line = f"; turns {turns['rejected']}/{turns['judged']} rejected" if turns else ""
    return line + (f"; thinking on {modes['on']}, off {modes['off']}" if modes else "")


def print_enqueue_report(report: EnqueueReport, storage: Storage, as_json: bool) -> None:
    from producer.dryrun import drafter_line, unused_lines, where

    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
        return
    good = report.rows - report.rejected
    click.echo(f"run {report.run}: {report.rows} rows read, {good} good, "
               f"{report.rejected} rejected; {report.shards} shards "
               f"({report.committed} committed), {report.enqueued} "
               + ("would be queued (dry run: nothing written)" if report.dry_run
                  else "queued now")
               + (f", {report.downstream} committed shards queued downstream"
                  if report.downstream else ""))
    if report.sampling:
        click.echo(sampling_line(report.sampling))
    if report.drafter:
        click.echo(drafter_line(report.drafter))
    if len(report.layouts) > 1 or any(len(c) > 1 for c in report.layouts.values()):
        for name, counts in report.layouts.items():
            click.echo(f"  {name}: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    for line in unused_lines(report.unused):
        click.echo(line)
    if report.rejected:
        click.echo(f"rejected rows (full list under {storage.root.rstrip('/')}/"
                   f"runs/{report.run}/rejected/input/):")
        for example in report.examples:
            click.echo(f"  {where(example)}: {example['reason']}")
        if report.rejected > len(report.examples):
            click.echo(f"  ... and {report.rejected - len(report.examples)} more")


def render_status(status: RunStatus) -> str:
    shards, samples, gates = status["shards"], status["samples"], status["gates"]
    total = samples["total"] if samples["total"] is not None else "?"
    eta = status["eta_s"]
    lines = [f"run {status['run']}: {status['state']}   ({status['storage']})"]
    if not status["redis"]["reachable"]:
        lines.append("  REDIS UNREACHABLE: live figures (running, rates, ETA, parked) unknown; "
                     "counts below come from storage")
    lines += [
        f"  shards  {shards['committed']}/{shards['total']} committed, "
        + ", ".join(f"{_known(shards[k])} {k}" for k in
                    ("running", "healing", "retrying", "pending", "parked")),
        f"  samples {samples['done']}/{total} done, {samples['in_progress']} in uncommitted "
        f"parts, {samples['rejected']} rejected",
        f"  gates   {gates['rejected']}/{gates['checked']} conversations rejected "
        f"({gates['rate']:.1%})" + _turn_line(gates)
        + "".join(f", {r} {n}" for r, n in gates["reasons"].items()),
        f"  speed   {_known(status['tokens']['per_s'], '.1f')} tok/s, "
        f"{_known(status['samples_per_s'], '.2f')} samples/s, "
        f"ETA {_duration(eta) if eta is not None else '?'}",
    ]
    down = status.get("downstream") or {}
    if down:
        lines.append(f"  {down['stage']:<7} {down['committed']}/{shards['committed']} committed "
                     f"shards done ({down['mode']}), {_known(down.get('parked'))} parked")
        train = down.get("train") or {}
        if train.get("step") is not None:
            lr = f"{train['lr']:.2e}" if train.get("lr") is not None else "?"
            lines.append(
                f"  training epoch {train.get('epoch')}/{train.get('epochs')}, step "
                f"{train['step']}/{_known(train.get('total_steps'))}, lr {lr}, " + (
                    f"finished ({down['finished']})" if down.get("finished") else
                    f"ETA {_duration(eta_s) if (eta_s := train.get('eta_s')) else '?'}")
                + ("; held-out tau by epoch " + ", ".join(
                    "-" if t is None else f"{t:.3f}" for t in train["tau_by_epoch"])
                   if train.get("tau_by_epoch") else ""))
            tau = (f"tau {down['tau']:.3f} measured at step {down['tau_step']}"
                   if down.get("tau") is not None else "tau not measured yet")
            lines.append(f"  drafter step {train.get('step')}: loss {train.get('loss')}, slot-1 "
                         f"accuracy {train.get('slot1_accuracy')}, {tau} (training estimate "
                         f"{train.get('acceptance_length')}), {train.get('tokens_per_s')} tok/s"
                         + (f" on {train['ranks']} ranks, {train.get('hosts', 1)} host(s)"
                            if count_of(field_key(TRAIN.keys(status["run"]).metrics, "ranks"),
                                        train.get("ranks"), 1) > 1 else ""))
            if hours := epoch_hours_line(train):
                lines.append(hours)
        aside = down.get("rows_set_aside") or {}
        if any(aside.values()):
            lines.append(f"  rows    {aside.get('too_short', 0)} too short to train and "
                         f"{aside.get('too_long', 0)} that no micro-batch fits set aside, "
                         f"{aside.get('cut', 0)} cut to the run's --max-train-tokens")
        if down.get("memory_plan"):
            lines.append(f"  memory  {down['memory_plan']}")
        if int((down.get("train") or {}).get("oom_retries") or 0):
            lines.append(f"  memory  {down['train']['oom_retries']} out-of-memory retries (each at "
                         "half the budget, activation checkpointing on)")
        if drafter := status.get("drafter"):
            lines.append(f"  drafter shape from {drafter['source']}")
        if error := down.get("eval_error"):
            lines.append(f"  drafter eval failed at step {error['step']} "
                         f"(training went on): {error['message']}")
    lines += [f"  parked {p['stage']} shard {p['shard']}: {p['reason']}"
              for p in status["parked"] or []]
    if pause := status.get("pause"):
        lines += pause_lines(pause, gates)
        lines.append(f"  see `dflash-pipeline report --run {status['run']}`, then `dflash-pipeline "
                     f"resume --run {status['run']} --accept-gates` to continue")
    lines += [f"  engine {name}: {e['url']}" + (f" (log {e['log']})" if e.get("log") else "")
              for name, e in sorted((status.get("engines") or {}).items())]
    lines += [f"  mtp    {name}: {m['mtp']} ({m['mode']}): {m['reason']}"
              for name, m in (status.get("mtp") or {}).items()]
    lines += [f"  mtp    {name}: {s['algorithm'] or '?'}, accept length {s['accept_length']} "
              f"tokens per verify step ({s['output_tokens']} tokens in {s['verify_steps']} steps)"
              for name, s in (status.get("speculative") or {}).items()]
    return "\n".join(lines)


def _known(value: object, spec: str = "") -> str:
    """A live figure, or '?' where Redis could not say."""
    return "?" if value is None else format(value, spec)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def show_status(storage: Storage, client: redis.Redis, run: str, *, watch: bool,
                interval: float, as_json: bool) -> RunStatus:
    """Print the run's status (once, or until it ends with ``watch``); returns the last one."""
    reader = StatusReader(storage, client, run)
    if watch and not as_json:
        return watch_progress(reader, interval)
    while True:
        status = reader.read()
        click.echo(json.dumps(status, sort_keys=True) if as_json else render_status(status))
        if not watch or status["state"] in (RunState.DONE, RunState.FAILED, RunState.PAUSED):
            return status
        time.sleep(interval)


def watch_progress(reader: StatusReader, interval: float,
                   check: Callable[[], None] = lambda: None) -> RunStatus:
    """A live progress bar (rich) until the run is done or failed; returns the last status.

    ``check`` runs every refresh and may raise to abort (the demo uses it to notice a dead worker).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        bar = progress.add_task(reader.run, total=None, detail="")
        while True:
            status = reader.read()
            samples = status["samples"]
            progress.update(
                bar, total=samples["total"], completed=samples["done"] + samples["in_progress"],
                detail=f"{status['state']} | shards {status['shards']['committed']}/"
                       f"{status['shards']['total']} | {_known(status['tokens']['per_s'], '.0f')}"
                       " tok/s",
            )
            if status["state"] in (RunState.DONE, RunState.FAILED, RunState.PAUSED):
                return status
            check()
            time.sleep(interval)
