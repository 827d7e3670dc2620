"""``dflash-pipeline demo``: its options; the run itself is :mod:`producer.demo`."""

from __future__ import annotations

import sys
from typing import Any

import click

from common.cli import setting_option, setup_logging
from common.errors import DflashError
from common.exit_codes import EXIT_FAILURE

DEMO_EPOCHS = 3
"""More than one pass, as the recipes train, sized for two CPU cores (a run's default is
:data:`common.runs.epochs.RECIPE_EPOCHS`)."""


@click.command()
@click.option("--input", "input_path", default="data/mt_bench_question.jsonl",
              show_default=True, help="Prompt file to regenerate.")
@click.option("--out", default="demo-output", show_default=True,
              help="Directory for storage, Redis data and logs.")
@click.option("--run", default="mt-bench-demo", show_default=True, help="Run id.")
@click.option("--shard-size", type=click.IntRange(min=1), default=10, show_default=True,
              help="Conversations per shard.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Generation budget per assistant turn.")
@click.option("--flower/--no-flower", default=True, show_default=True,
              help="Start Flower to watch the worker.")
@click.option("--flower-port", type=int, default=5555, show_default=True, help="Flower port.")
@click.option("--ui/--no-ui", default=True, show_default=True, help="Start the run dashboard.")
@click.option("--ui-port", type=int, default=8700, show_default=True, help="Dashboard port.")
@click.option("--quick", is_flag=True,
              help="Generation only: an offline run, no drafter training, eval or export.")
@setting_option("model", help="Target: tiny-qwen3 (dense) or tiny-qwen3.5 (hybrid, Qwen3.6's "
                "shape), the embedded CPU models, or a local model directory.")
@click.option("--epochs", type=click.IntRange(min=1), default=DEMO_EPOCHS, show_default=True,
              help="Epochs the drafter trains over the demo's data (the schedule follows; a "
                   "real run's default is the recipe's, see `enqueue --epochs`).")
@click.option("--eval-prompts", type=click.IntRange(min=1), default=16, show_default=True,
              help="Held-out prompts the final acceptance-length eval decodes.")
@click.option("--eval-max-new-tokens", type=click.IntRange(min=1), default=128,
              show_default=True, help="Token budget per prompt of the final eval.")
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
