"""``dflash-pipeline worker hidden``: a Celery worker on queue ``hidden`` (one shard at a time)."""

from __future__ import annotations

from workers.launch import Launch
from workers.worker_cli import stage_worker

worker_hidden = stage_worker(
    Launch("hidden", app="workers.downstream_app"),
    "Run a Celery worker on queue `hidden`: target hidden states of committed shards.")
