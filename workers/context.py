"""Per-process worker state every stage shares: settings, storage, Redis, the stop flag."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import cached_property

import redis

from common.config import Settings, load_settings
from common.storage import Storage, open_storage

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What every stage uses; a stage's own state (generate's engine) lives in its folder."""

    settings: Settings
    stopping: threading.Event = field(default_factory=threading.Event)

    @cached_property
    def storage(self) -> Storage:
        return open_storage(self.settings.broker.storage, self.settings.read)

    @cached_property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(
            self.settings.broker.url, decode_responses=True, socket_timeout=30,
            health_check_interval=10, retry_on_timeout=True,
        )


_context: WorkerContext | None = None
_lock = threading.Lock()


def get_context() -> WorkerContext:
    """The process's context, built on first use and shared by the stage tasks and reconciler."""
    global _context
    with _lock:
        if _context is None:
            _context = WorkerContext(load_settings())
            log.info("worker settings %r", _context.settings)
        return _context
