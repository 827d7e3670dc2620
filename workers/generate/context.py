"""The generate stage's per-process state: the worker's context plus the engine, built once."""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass, field
from functools import cached_property

import redis

from common.config import Settings
from common.engine.models import resolve_model_path, stop_token_ids
from common.engine.mtp import choose_mtp, target_shape
from common.errors import ConfigError
from common.gates.judge import TokenInfo
from common.queue import redis_keys
from workers.context import WorkerContext, get_context
from workers.generate.engines.base import Engine, EngineLoop
from workers.generate.engines.cpu import CpuEngine

log = logging.getLogger(__name__)


def build_engine(settings: Settings) -> Engine:
    """The worker's engine: in-process CPU model, or an SGLang server (started or given)."""
    model_path, gen = resolve_model_path(settings), settings.generate
    if gen.engine not in ("cpu", "sglang"):
        raise ConfigError(f"unknown engine {gen.engine!r}; choose cpu or sglang")
    mtp = choose_mtp(settings, target_shape(model_path))   # logged once the worker is ready
    if gen.engine == "cpu":
        cpu = CpuEngine(model_path, batch_size=gen.batch_size)
        cpu.mtp = mtp
        return cpu
    from transformers import AutoTokenizer

    from workers.generate.engines.server import EngineServer, server_command
    from workers.generate.engines.sglang import SglangEngine

    server = None
    url = gen.engine_url
    if not url:
        url = f"http://127.0.0.1:{settings.engine_server_port}"
        server = EngineServer(server_command(settings, model_path, mtp.args), url,
                              settings.engines_dir, gen.engine_startup_timeout,
                              gen.engine_drain_timeout)
        server.start()
    return SglangEngine(url, AutoTokenizer.from_pretrained(model_path), gen.max_in_flight,
                        gen.request_timeout, retry_window=gen.engine_startup_timeout,
                        stop_ids=stop_token_ids(model_path), server=server, mtp=mtp)


@dataclass
class GenerateContext:
    """The process's :class:`WorkerContext` (settings, storage, Redis, stopping) and its engine."""

    worker: WorkerContext
    _engine: Engine | None = None
    _engine_lock: threading.Lock = field(default_factory=threading.Lock)
    loop: EngineLoop = field(default_factory=EngineLoop)

    def close_engine(self) -> None:
        with self._engine_lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    @property
    def engine(self) -> Engine:
        """Built once; concurrent shards wait for the first build instead of racing it."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = build_engine(self.worker.settings)
            return self._engine

    @cached_property
    def tokens(self) -> TokenInfo:
        """Special and think-marker ids of the engine's tokenizer, for the quality gates."""
        return TokenInfo.of(self.engine.tokenizer)


_context: GenerateContext | None = None
_lock = threading.Lock()


def get_generate_context() -> GenerateContext:
    """The process's generate context, around the shared worker context (engine built lazily)."""
    global _context
    with _lock:
        if _context is None:
            _context = GenerateContext(get_context())
        return _context


def warm_engine(worker: str | None = None) -> None:
    """Build the engine now so the first shard does not pay for it (called at worker start);
    ``worker`` is the Celery node name the engine is announced under."""
    context = get_generate_context()
    announce_engine(context.worker, context.engine, worker)


def announce_engine(context: WorkerContext, engine: Engine, worker: str | None = None) -> None:
    """Tell ``status`` where this worker's engine server and its log are (advisory), which
    worker owns it and its speculative algorithm (the dashboard's Engines panel)."""
    server, url = getattr(engine, "server", None), getattr(engine, "url", None)
    if url is None:  # the in-process CPU engine has no server to show
        return
    record = ({"url": server.url, "log": str(server.log_path), "pid": server.proc.pid}
              if server is not None else {"url": url, "log": None, "pid": None})
    record.update(worker=worker, algorithm=getattr(engine, "algorithm", None))
    try:
        context.redis.hset(redis_keys.redis_engines(),
                           f"{socket.gethostname()}:gpu{context.settings.worker.gpu}",
                           json.dumps(record))
    except redis.RedisError as err:
        log.warning("engine location not published: %s", err)
