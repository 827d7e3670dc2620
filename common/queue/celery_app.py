"""The Celery app shared by producer, workers and Flower (its delivery settings: docs/concepts/
reconciler.md, "Celery's delivery settings").

Workers run ``celery -A workers.generate.app worker`` (via ``dflash-pipeline worker
generate``); Flower runs ``celery -A common.queue.celery_app flower``; the producer sends tasks
by name and never imports workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery

from common.choices import Stage
from common.config import Settings, load_settings
from common.queue import redis_keys
from common.queue.shard_registry import ShardRegistry

QUEUE_GENERATE = "generate"
QUEUE_HIDDEN = "hidden"
QUEUE_TRAIN = "train"

TASK_GENERATE = "dflash.generate_shard"
TASK_HIDDEN = "dflash.hidden_shard"
TASK_TRAIN = "dflash.train_shard"


@dataclass(frozen=True)
class StageSpec:
    """A shard stage: its name (its Redis registries), task and queue; ``one_per_run`` stages
    hold one lease per run instead of one per shard (one drafter trainer per run)."""

    name: str   # a Stage's text: the key of stage-keyed records (orjson takes str keys)
    task_name: str
    queue: str
    one_per_run: bool = False

    def keys(self, run: str) -> redis_keys.StageKeys:
        return redis_keys.StageKeys(run, self.name)

    def registry(self, client: redis.Redis, run: str) -> ShardRegistry:
        """The stage's shard registry for ``run``: every Redis operation on its shards."""
        return ShardRegistry(client, self.keys(run))

    def lease_key(self, run: str, shard: int) -> str:
        return self.keys(run).lease(None if self.one_per_run else shard)


GENERATE = StageSpec(Stage.GENERATE.value, TASK_GENERATE, QUEUE_GENERATE)
HIDDEN = StageSpec(Stage.HIDDEN.value, TASK_HIDDEN, QUEUE_HIDDEN)
TRAIN = StageSpec(Stage.TRAIN.value, TASK_TRAIN, QUEUE_TRAIN, one_per_run=True)
STAGES = (GENERATE, HIDDEN, TRAIN)


def celery_config(settings: Settings) -> dict[str, object]:
    """Celery settings: identical in every process, so no visibility timeout is shorter."""
    transport = {"visibility_timeout": settings.broker.visibility_timeout}
    return {
        "broker_url": settings.broker.url,
        "result_backend": settings.broker.url,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": settings.broker.result_expires,
        "worker_soft_shutdown_timeout": settings.broker.soft_shutdown_timeout,
        "worker_enable_soft_shutdown_on_idle": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_routes": {
            TASK_GENERATE: {"queue": QUEUE_GENERATE},
            TASK_HIDDEN: {"queue": QUEUE_HIDDEN},
            TASK_TRAIN: {"queue": QUEUE_TRAIN},
        },
        "task_default_queue": QUEUE_GENERATE,
    }


def make_app(settings: Settings) -> Celery:
    app = Celery("dflash")
    app.conf.update(celery_config(settings))
    return app


app = make_app(load_settings())
