"""The ``dflash-pipeline`` command line: enqueue, resume, status, report, worker, export, demo.

Every option can also come from its ``DFLASH_*`` environment variable. Exit codes: 0 success,
1 failure, 2 bad usage, 3 enqueue finished but rejected some input rows, 4 the run id exists
with a different configuration.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import click

from common.cli import FiniteRange, common_options, options_for
from common.config import Settings, load_settings
from common.declared import opt
from common.entry_points import COMMANDS, EntryPointGroup
from common.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_REJECTED
from common.runs.options import RunOptions
from producer.services import open_services as _services


@dataclass(frozen=True)
class RunCommandOptions:
    """``enqueue``'s, ``resume``'s and ``status``'s own options (the run's are RunOptions')."""

    dry_run: bool = opt(
        False, is_flag=True, commands=("enqueue",),
        at={"resume": {"help": "Say what would be queued; queue nothing, lift no pause, write "
                               "nothing."}},
        help="Read and validate everything, write nothing, show rows as the model sees them.")
    show: int = opt(3, type=click.IntRange(min=0), commands=("enqueue",),
                    help="Rows to print with --dry-run.")
    force: bool = opt(False, is_flag=True, commands=("resume",),
                      help="Queue unfinished shards even if a task for them is already queued.")
    accept_gates: bool = opt(
        False, is_flag=True, commands=("resume",),
        help="Lift a quality-gate pause, accepting the rejections so far; the monitor keeps "
             "watching the samples that follow.")
    watch: bool = opt(False, is_flag=True, commands=("status",),
                      help="Refresh until the run is done, failed or paused.")
    interval: float = opt(2.0, type=FiniteRange(min=0.2), commands=("status",),
                          help="Seconds between refreshes with --watch.")


@click.group(cls=EntryPointGroup, entry_group=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash-pipeline")
def main() -> None:
    """Regenerate a prompt set with a target LLM into DFlash drafter training data."""


@main.command()
@options_for("enqueue", RunCommandOptions)
@common_options
def enqueue(settings: Settings, dry_run: bool, show: int, model: str | None, as_json: bool,
            **values: Any) -> None:
    """Validate the input, write run.json and input shards, queue one task per shard."""
    from producer.commands import (
        build_run_config,
        context_check,
        drafter_in_force,
        print_enqueue_report,
        sampling_in_force,
    )
    from producer.enqueue import enqueue_run

    settings = load_settings(storage=settings.broker.storage, broker_url=settings.broker.url,
                             model=model)
    config = build_run_config(settings, RunOptions.from_cli(values))
    if dry_run:  # no storage, no Redis: nothing is written anywhere
        from producer.dryrun import dry_run as run_dry

        dry = run_dry(settings, config, context_check(settings, config), show)
        dry.sampling, dry.drafter = sampling_in_force(config), drafter_in_force(config)
        click.echo(json.dumps(dry.to_json(), sort_keys=True) if as_json else dry.render())
        sys.exit(EXIT_REJECTED if dry.rejected else EXIT_OK)
    storage, app, client = _services(settings)
    report = enqueue_run(storage, app, client, config, context_check(settings, config))
    report.sampling, report.drafter = sampling_in_force(config), drafter_in_force(config)
    print_enqueue_report(report, storage, as_json)
    if report.rejected:
        sys.exit(EXIT_REJECTED)


@main.command()
@options_for("resume", RunCommandOptions)
@common_options
def resume(settings: Settings, run: str, force: bool, accept_gates: bool,
           max_reject_rate: float | None, pause_after: int | None, dry_run: bool,
           as_json: bool) -> None:
    """Re-queue every shard without a commit, from storage alone (after a crash, wipe or pause).

    A new --max-reject-rate or --pause-after replaces the run's and lifts a quality-gate pause.
    """
    from producer.commands import context_check, print_enqueue_report
    from producer.enqueue import read_run_config, resume_run

    storage, app, client = _services(settings)
    config = read_run_config(storage, run)
    if config is not None and not dry_run:
        from common.monitor.run_monitor import resume_gates

        lifted = resume_gates(client, storage, run, config.gates, accept=accept_gates,
                              max_reject_rate=max_reject_rate, pause_after=pause_after)
        if lifted and not as_json:
            click.echo(f"run {run}: quality gates resumed (max reject rate "
                       f"{lifted['max_reject_rate']:.0%} over {lifted['pause_after']} samples"
                       + (", rejections so far accepted)" if accept_gates else ")"))
    report = resume_run(storage, app, client, run, force=force,
                        check_for=lambda c: context_check(settings, c),
                        lease_ttl=settings.worker.lease_ttl, dry_run=dry_run)
    print_enqueue_report(report, storage, as_json)


@main.command()
@options_for("status", RunCommandOptions)
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




# Commands defined beside what they run; the stages' join through the entry points (COMMANDS).
from producer.bench_command import bench  # noqa: E402
from producer.dataset_export import export_dataset_command  # noqa: E402
from producer.demo_command import demo  # noqa: E402
from producer.doctor.command import doctor_command  # noqa: E402
from producer.doctor.serve_command import serve_command_command  # noqa: E402
from producer.plan import plan_storage  # noqa: E402
from producer.plan_training import plan_training  # noqa: E402
from producer.report import report_command  # noqa: E402
from producer.ui.command import ui_command  # noqa: E402

for command in (bench(common_options), demo, plan_storage, plan_training, export_dataset_command,
                doctor_command(common_options), serve_command_command(common_options),
                report_command(common_options), ui_command(common_options)):
    main.add_command(command)


if __name__ == "__main__":
    main()
