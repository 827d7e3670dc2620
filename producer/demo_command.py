"""``dflash-pipeline demo``: its options; the run itself is :mod:`producer.demo`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import click

from common.cli import options_for, setup_logging
from common.declared import opt
from common.errors import DflashError
from common.exit_codes import EXIT_FAILURE

DEMO_EPOCHS = 3
"""More than one pass, as the recipes train, sized for two CPU cores (a run's default is
:data:`common.runs.epochs.RECIPE_EPOCHS`)."""


@dataclass(frozen=True, kw_only=True)
class DemoCommandOptions:
    """``demo``'s own options."""

    input_path: str = opt(
        "data/mt_bench_question.jsonl", decls=("--input",), commands=("demo",),
        help="Prompt file to regenerate.")
    out: str = opt(
        "demo-output", commands=("demo",),
        help="Directory for storage, Redis data and logs.")
    shard_size: int = opt(
        10, commands=("demo",), type=click.IntRange(min=1),
        help="Conversations per shard.")
    max_new_tokens: int = opt(
        256, commands=("demo",), type=click.IntRange(min=1),
        help="Generation budget per assistant turn.")
    flower: bool = opt(
        True, decls=("--flower/--no-flower",), commands=("demo",),
        help="Start Flower to watch the worker.")
    flower_port: int = opt(
        5555, commands=("demo",), type=int,
        help="Flower port.")
    ui: bool = opt(
        True, decls=("--ui/--no-ui",), commands=("demo",),
        help="Start the run dashboard.")
    ui_port: int = opt(
        8700, commands=("demo",), type=int,
        help="Dashboard port.")
    quick: bool = opt(
        False, commands=("demo",), is_flag=True,
        help="Generation only: an offline run, no drafter training, eval or export.")
    epochs: int = opt(
        DEMO_EPOCHS, commands=("demo",), type=click.IntRange(min=1),
        help="Epochs the drafter trains over the demo's data (the schedule follows; a "
             "real run's default is the recipe's, see `enqueue --epochs`).")
    eval_prompts: int = opt(
        16, commands=("demo",), type=click.IntRange(min=1),
        help="Held-out prompts the final acceptance-length eval decodes.")
    eval_max_new_tokens: int = opt(
        128, commands=("demo",), type=click.IntRange(min=1),
        help="Token budget per prompt of the final eval.")


@click.command()
@options_for("demo", DemoCommandOptions)
def demo(**options: Any) -> None:
    """Run the whole product locally: Redis, a generate worker and a train worker side by side,
    Flower, the dashboard; then measure the drafter and export the dataset and the drafter."""
    from producer.demo import DemoOptions, run_demo

    setup_logging(False)
    try:
        code = run_demo(DemoOptions(**options))
    except DflashError as exc:
        click.echo(f"error: {exc}", err=True)
        code = EXIT_FAILURE
    sys.exit(code)
