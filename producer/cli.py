"""The ``dflash-pipeline`` command line: enqueue, resume, status, report, worker, export, demo.

Every option can also come from its ``DFLASH_*`` environment variable. Exit codes: 0 success,
1 failure, 2 bad usage, 3 enqueue finished but rejected some input rows, 4 the run id exists
with a different configuration.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from common.cli import command_option, common_options, setting_option
from common.config import Settings, load_settings
from common.entry_points import COMMANDS, EntryPointGroup
from common.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_REJECTED
from common.inputs.layouts import FORMATS
from producer.services import open_services as _services

SKIPPABLE_GATES = ("truncated", "thinking", "empty_answer", "leakage", "duplicates")


def gate_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Quality-gate thresholds of enqueue, frozen into run.json."""
    options = [
        command_option("min_supervised_tokens", type=click.IntRange(min=0),
                       help="Reject a sample with a turn of fewer generated tokens "
                            "(2 x the DFlash block size)."),
        command_option("max_reject_rate", type=click.FloatRange(0, 1),
                       help="Pause the run when the rolling rejection rate exceeds this."),
        command_option("pause_after", type=click.IntRange(min=1),
                       help="Samples the rolling rejection rate is taken over."),
        command_option("min_answer_tokens", type=click.IntRange(min=0),
                       help="Reject at enqueue a prompt that leaves less room than this per "
                            "answer in the model's context; at generation, a turn whose "
                            "prompt leaves less in the server's context is not sent "
                            "(context_overflow)."),
        click.option("--skip-gate", "skip", multiple=True, type=click.Choice(SKIPPABLE_GATES),
                     help="Turn a per-sample gate off (repeatable)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def template_kwargs_option(ctx: click.Context, param: click.Parameter,
                          value: str | None) -> dict[str, Any] | None:
    """--chat-template-kwargs: a JSON object of template options, never enable_thinking."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"must be a JSON object, e.g. '{{\"preserve_thinking\": "
                                 f"true}}', not {value!r}")
    if "enable_thinking" in parsed:
        raise click.BadParameter("enable_thinking is --thinking on|off|mix:R")
    return parsed


def thinking_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--thinking: on, off or mix:R, checked here so a bad value is one usage error."""
    from common.thinking import describe, parse_thinking

    try:
        return describe(*parse_thinking(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(cls=EntryPointGroup, entry_group=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash-pipeline")
def main() -> None:
    """Regenerate a prompt set with a target LLM into DFlash drafter training data."""


@main.command()
@command_option("input", "--input", "input_path", required=True, multiple=True,
                help="A JSONL/JSON/Parquet/Arrow file, a directory of them (a Hugging Face "
                     "dataset too), a quoted glob, or s3://bucket/key, prefix/ or glob; "
                     "repeatable.")
@command_option("run", required=True, help="Run id (letters, digits, ._-).")
@command_option("format", "--format", "fmt", type=click.Choice(FORMATS),
                help="Row layout; auto detects it per row.")
@command_option("prompt_field", help="Field holding the prompt for --format prompt.")
@command_option("prompt_template",
                help="Build the prompt from the row's fields instead, e.g. "
                     "'{instruction}\\n\\n{context}' (\\n is a newline); placeholders name "
                     "fields only: {field} or {field:spec}.")
@command_option("strict_fields", is_flag=True,
                help="Reject a row with text no prompt uses (a string, or text in a list or "
                     "object field), instead of reporting it.")
@click.option("--dry-run", is_flag=True,
              help="Read and validate everything, write nothing, show rows as the model sees "
                   "them.")
@click.option("--show", type=click.IntRange(min=0), default=3, show_default=True,
              help="Rows to print with --dry-run.")
@command_option("shard_size", type=click.IntRange(min=1),
                help="Conversations per shard (one task each).")
@command_option("limit", type=click.IntRange(min=1), help="Read at most this many input rows.")
@command_option("max_new_tokens", type=click.IntRange(min=1),
                help="Generation budget per assistant turn [default: what the target's "
                     "context allows, at most 32768; each request is capped to the room its "
                     "prompt leaves].")
@command_option("temperature", type=click.FloatRange(min=0),
                help="Sampling temperature (0 = greedy) [default: the target's "
                     "generation_config.json, else 0.6].")
@command_option("top_p", type=click.FloatRange(min=0, max=1, min_open=True),
                help="Nucleus sampling mass [default: the target's, else 0.95].")
@command_option("top_k", type=click.IntRange(min=-1),
                help="Top-k sampling (-1 = off) [default: the target's, else 20].")
@command_option("min_p", type=click.FloatRange(min=0, max=1),
                help="Min-p sampling [default: the target's, else 0].")
@command_option("repetition_penalty", type=click.FloatRange(min=0, max=2, min_open=True),
                help="Repetition penalty (1 = off) [default: the target's, else 1].")
@command_option("presence_penalty", type=click.FloatRange(min=-2, max=2),
                help="Presence penalty [default: the target's, else 0].")
@command_option("thinking", "--thinking", metavar="on|off|mix:R", is_flag=False,
                flag_value="on", callback=thinking_option,
                help="Render prompts with thinking on, off, or off for a stable share R of "
                     "conversations chosen by id (mix:0.5); each sample records its mode.")
@click.option("--no-thinking", is_flag=True, help="The same as --thinking off.")
@command_option("chat_template_kwargs", callback=template_kwargs_option, metavar="JSON",
                help="Options every render passes to the target's chat template, frozen in "
                     "run.json, e.g. '{\"preserve_thinking\": true}' (thinking itself: "
                     "--thinking).")
@setting_option("model", help="Target model directory (tiny-qwen3, tiny-qwen3.5: the embedded "
                "CPU models).")
@command_option("mode", type=click.Choice(["offline", "online"]),
                help="After a shard's commit: offline stores target hidden states (queue "
                     "hidden); online trains the drafter on the fly (queue train, nothing "
                     "stored).")
@command_option("layout", type=click.Choice(["dflash", "eagle3"]),
                help="Target layers kept for the drafter.")
@command_option("target_layers",
                help="Target layers of the dflash layout: K (the DFlash spread of K layers), a "
                     "comma list of layer ids, or dflash|full-attention|after-full[:K] "
                     "[default: dflash (5 layers) on a dense target, after-full on a hybrid; "
                     "with --drafter-config/--init-drafter: its dflash_config.target_layer_ids]."
                )
@command_option("drafter_config", metavar="FILE",
                help="Shape the run's drafter as this published DFlash config.json says (layers, "
                     "sliding windows, heads, block, target layers; the target gives the rest). "
                     "Checked against the target now and frozen in run.json with its digest: "
                     "every train worker trains this shape. Its target_layer_ids become the "
                     "run's target layers (--target-layers, if given, must agree).")
@command_option("init_drafter", metavar="DIR",
                help="Start the run's drafter from a released DFlash drafter (config.json + "
                     "safetensors, as export-drafter writes and z-lab publishes): its shape is "
                     "checked and frozen as with --drafter-config, and its directory and weights "
                     "digest too; train workers read it at that path and verify the digest.")
@command_option("heldout_fraction", type=click.FloatRange(0, 1, max_open=True),
                help="Samples (by id hash) never trained on, decoded by eval-drafter.")
@command_option("heldout_min", type=click.IntRange(min=0),
                help="Hold out at least this many samples (at most half a small input).")
@command_option("epochs", type=click.IntRange(min=1),
                help="Passes the drafter trains over the run's training rows (the published "
                     "DFlash recipe's 10); the learning-rate schedule is epochs x rows / rows "
                     "per step long. Later epochs revisit the samples in a new seeded order.")
@command_option("patience", type=click.IntRange(min=1),
                help="Stop training after this many end-of-epoch evaluations without a better "
                     "held-out acceptance length [default: never; every epoch trains].")
@gate_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@common_options
def enqueue(settings: Settings, input_path: tuple[str, ...], run: str, fmt: str,
            prompt_field: str | None, prompt_template: str | None, strict_fields: bool,
            dry_run: bool, show: int, shard_size: int, limit: int | None, max_new_tokens: int,
            temperature: float | None, top_p: float | None, top_k: int | None,
            min_p: float | None, repetition_penalty: float | None,
            presence_penalty: float | None, thinking: str, no_thinking: bool,
            chat_template_kwargs: dict[str, Any] | None, model: str | None,
            mode: str, layout: str, target_layers: str | None, drafter_config: str | None,
            init_drafter: str | None, heldout_fraction: float, heldout_min: int, epochs: int,
            patience: int | None, as_json: bool, **gates: Any) -> None:
    """Validate the input, write run.json and input shards, queue one task per shard."""
    from producer.commands import (
        build_gates,
        build_run_config,
        context_check,
        drafter_in_force,
        print_enqueue_report,
        sampling_in_force,
    )
    from producer.enqueue import enqueue_run

    settings = load_settings(storage=settings.storage, broker_url=settings.broker_url,
                             model=model)
    config = build_run_config(settings, run=run, input_path=input_path, fmt=fmt,
                              prompt_field=prompt_field, shard_size=shard_size, limit=limit,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k,
                              thinking="off" if no_thinking else thinking,
                              min_p=min_p, repetition_penalty=repetition_penalty,
                              presence_penalty=presence_penalty,
                              chat_template_kwargs=chat_template_kwargs,
                              gates=build_gates(**gates), mode=mode, layout=layout,
                              target_layers=target_layers, drafter_config=drafter_config,
                              init_drafter=init_drafter,
                              prompt_template=_unescape(prompt_template),
                              strict_fields=strict_fields,
                              heldout_fraction=heldout_fraction, heldout_min=heldout_min,
                              epochs=epochs, patience=patience)
    if dry_run:  # no storage, no Redis: nothing is written anywhere
        from producer.dryrun import dry_run as run_dry

        report = run_dry(settings, config, context_check(settings, config), show)
        report.sampling, report.drafter = sampling_in_force(config), drafter_in_force(config)
        click.echo(json.dumps(report.to_json(), sort_keys=True) if as_json else report.render())
        sys.exit(EXIT_REJECTED if report.rejected else EXIT_OK)
    storage, app, client = _services(settings)
    report = enqueue_run(storage, app, client, config, context_check(settings, config))
    report.sampling, report.drafter = sampling_in_force(config), drafter_in_force(config)
    print_enqueue_report(report, storage, as_json)
    if report.rejected:
        sys.exit(EXIT_REJECTED)


@main.command()
@command_option("run", required=True, help="Run id to resume.")
@click.option("--force", is_flag=True,
              help="Queue unfinished shards even if a task for them is already queued.")
@click.option("--accept-gates", is_flag=True,
              help="Lift a quality-gate pause, accepting the rejections so far; the monitor "
                   "keeps watching the samples that follow.")
@click.option("--max-reject-rate", type=click.FloatRange(0, 1), default=None,
              help="New pause threshold for the rejection rate (lifts a pause too).")
@click.option("--pause-after", type=click.IntRange(min=1), default=None,
              help="New size of the rolling window the rate is taken over (lifts a pause too).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@common_options
def resume(settings: Settings, run: str, force: bool, accept_gates: bool,
           max_reject_rate: float | None, pause_after: int | None, as_json: bool) -> None:
    """Re-queue every shard without a commit, from storage alone (after a crash, wipe or pause)."""
    from producer.commands import context_check, print_enqueue_report
    from producer.enqueue import read_run_config, resume_run

    storage, app, client = _services(settings)
    config = read_run_config(storage, run)
    if config is not None:
        from common.monitor import resume_gates

        lifted = resume_gates(client, storage, run, config.gates, accept=accept_gates,
                              max_reject_rate=max_reject_rate, pause_after=pause_after)
        if lifted and not as_json:
            click.echo(f"run {run}: quality gates resumed (max reject rate "
                       f"{lifted['max_reject_rate']:.0%} over {lifted['pause_after']} samples"
                       + (", rejections so far accepted)" if accept_gates else ")"))
    report = resume_run(storage, app, client, run, force=force,
                        check_for=lambda c: context_check(settings, c),
                        lease_ttl=settings.lease_ttl)
    print_enqueue_report(report, storage, as_json)


@main.command()
@command_option("run", required=True, help="Run id.")
@click.option("--watch", is_flag=True,
              help="Refresh until the run is done, failed or paused.")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (per refresh).")
@common_options
def status(settings: Settings, run: str, watch: bool, interval: float, as_json: bool) -> None:
    """Shards, samples, tokens/s and ETA of a run (from storage alone, exit 1, if Redis is down)."""
    from producer.commands import show_status

    storage, _, client = _services(settings, need_redis=False)
    last = show_status(storage, client, run, watch=watch, interval=interval, as_json=as_json)
    if not last["redis"]["reachable"]:
        click.echo(f"error: cannot reach Redis at {settings.masked_broker_url}: the figures "
                   "above come from storage alone (live ones unknown)", err=True)
        sys.exit(EXIT_FAILURE)


def _unescape(template: str | None) -> str | None:
    """Let a shell user write a newline in --prompt-template as \\n (and a tab as \\t)."""
    return None if template is None else template.replace("\\n", "\n").replace("\\t", "\t")


def dump_json(obj: Any) -> None:
    click.echo(json.dumps(obj, sort_keys=True))


# Commands defined beside what they run; the stages' join through the entry points (COMMANDS).
from producer.bench_command import bench  # noqa: E402
from producer.dataset_export import export_dataset_command  # noqa: E402
from producer.demo_command import demo  # noqa: E402
from producer.doctor.command import doctor_command  # noqa: E402
from producer.doctor.serve_command import serve_command_command  # noqa: E402
from producer.plan import plan_storage  # noqa: E402
from producer.report import report_command  # noqa: E402
from producer.ui.command import ui_command  # noqa: E402

for command in (bench(common_options), demo, plan_storage, export_dataset_command,
                doctor_command(common_options), serve_command_command(common_options),
                report_command(common_options), ui_command(common_options)):
    main.add_command(command)


if __name__ == "__main__":
    main()
