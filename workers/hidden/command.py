"""``dflash-pipeline worker hidden``: a Celery worker on queue ``hidden`` (one shard at a time)."""

from __future__ import annotations

import click

from common.cli import setting_option
from workers.launch import Launch
from workers.worker_cli import stage_worker

worker_hidden = stage_worker(
    Launch("hidden", app="workers.downstream_app"),
    "Run a Celery worker on queue `hidden`: target hidden states of committed shards.",
    setting_option("hidden_batch_tokens", "--batch-tokens", type=click.IntRange(min=1),
                   help="Padded tokens per forward pass (rows are batched by length)."))
