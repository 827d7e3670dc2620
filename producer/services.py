"""The services a run command talks to: storage, the Celery app and Redis."""

from __future__ import annotations

from typing import Any

from common.config import Settings
from common.errors import DflashError


def open_services(settings: Settings, need_redis: bool = True) -> tuple[Any, Any, Any]:
    """Storage, Celery app and Redis client; fails early and clearly if Redis is needed but down."""
    import redis

    from common.queue.celery_app import make_app
    from common.storage import open_storage

    client = redis.Redis.from_url(settings.broker.url, decode_responses=True, socket_timeout=30)
    if need_redis:
        try:
            client.ping()
        except redis.RedisError as exc:
            raise DflashError(f"cannot reach Redis at {settings.masked_broker_url}: {exc}") \
                from exc
    return open_storage(settings.broker.storage, settings.read), make_app(settings), client
