"""Per-process worker state: settings, storage, Redis and the engine, built once and shared."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import cached_property

import redis

from common.config import Settings, load_settings
from common.errors import ConfigError
from common.models import resolve_model_path
from common.storage import Storage, open_storage
from workers.engines.base import Engine, EngineLoop
from workers.engines.cpu import CpuEngine

log = logging.getLogger(__name__)


def build_engine(settings: Settings) -> Engine:
    if settings.engine == "cpu":
        return CpuEngine(resolve_model_path(settings), batch_size=settings.batch_size)
    raise ConfigError(f"unknown engine {settings.engine!r}; this build supports: cpu")


@dataclass
class WorkerContext:
    settings: Settings
    _engine: Engine | None = None
    _engine_lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    loop: EngineLoop = field(default_factory=EngineLoop)

    @cached_property
    def storage(self) -> Storage:
        return open_storage(self.settings.storage)

    @cached_property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(
            self.settings.broker_url, decode_responses=True, socket_timeout=30,
            health_check_interval=10, retry_on_timeout=True,
        )

    @property
    def engine(self) -> Engine:
        """Built once; concurrent shards wait for the first build instead of racing it."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = build_engine(self.settings)
            return self._engine


_context: WorkerContext | None = None
_lock = threading.Lock()


def get_context() -> WorkerContext:
    """The process's context; the engine inside it is built on first use (or at worker start)."""
    global _context
    with _lock:
        if _context is None:
            _context = WorkerContext(load_settings())
            log.info("worker settings %r", _context.settings)
        return _context


def warm_engine() -> None:
    """Build the engine now so the first shard does not pay for it (called at worker start)."""
    _ = get_context().engine
