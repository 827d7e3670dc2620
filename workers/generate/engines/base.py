"""What every engine speaks: requests of token ids in, exact output token ids out.

The chat template is applied once, by the worker; engines never re-tokenize. Engines:
``cpu`` (in-process transformers model), ``sglang`` (an SGLang server, or the simulator).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from common.records import Sampling

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GenRequest:
    input_ids: list[int]
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class GenResult:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    latency_s: float


class Engine(Protocol):
    """What a generate worker needs from an engine; ``generate`` runs on the worker's event loop."""

    tokenizer: Any

    async def generate(self, request: GenRequest) -> GenResult:
        """One completion; concurrent calls are how an engine's batch is kept full."""

    def info(self) -> dict[str, Any]:
        """A small description recorded with every sample (engine kind, model, version)."""

    def close(self) -> None:
        """Release the engine's resources (stop its server, if it owns one)."""


class EngineLoop:
    """The worker's one asyncio loop, on a daemon thread, shared by every shard it holds.

    Celery task threads submit coroutines here, so requests of two shards share the engine's
    in-flight slots: the tail of one shard overlaps the head of the next.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result from a foreign thread."""
        return self.submit(coro).result()

    def stop(self) -> None:
        """Stop the loop thread (a worker's lives as long as its process; tests stop theirs)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
