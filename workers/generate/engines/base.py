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
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict, TypeVar

from common.choices import EngineKind, FinishReason, Reason
from common.engine.sampling import Sampling
from common.errors import RequestRefused

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from common.engine.mtp import MtpChoice
    from workers.generate.engines.server import EngineServer

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GenRequest:
    input_ids: list[int]
    sampling: Sampling
    # The fewest new tokens worth asking for: a prompt that leaves less room is not sent.
    min_answer_tokens: int = 1

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What the serving engine holds, read from it: no request may ask for more."""

    context_length: int            # prompt + new tokens, at most (SGLang: the model's context)
    max_input_tokens: int          # a prompt must be shorter (SGLang's max_req_input_len)
    max_running_requests: int | None = None   # the running-request limit the server settled on


def fit_request(request: GenRequest, limits: ServerLimits | None) -> tuple[GenRequest, int]:
    """The request's ``max_new_tokens`` capped to the room its prompt leaves in the context.

    Refuses (``context_overflow``) a prompt the server would refuse, or one that leaves fewer
    than ``min_answer_tokens``: a 400 for that request, never a failed shard.
    """
    if limits is None:
        return request, request.max_new_tokens
    prompt = len(request.input_ids)
    room = limits.context_length - prompt
    need = max(1, min(request.min_answer_tokens, request.max_new_tokens))
    if prompt >= limits.max_input_tokens or room < need:
        raise RequestRefused(Reason.CONTEXT_OVERFLOW,
                             f"a prompt of {prompt} tokens leaves {max(room, 0)} of the "
                             f"server's {limits.context_length}-token context (at most "
                             f"{limits.max_input_tokens - 1} prompt tokens, at least "
                             f"{need} to answer)")
    return request, min(request.max_new_tokens, room)


@dataclass(frozen=True, slots=True)
class GenResult:
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    # The engine's speculative figures (SGLang's ``spec_*`` meta_info), None without drafts.
    speculative: dict[str, Any] | None = None


class EngineInfo(TypedDict):
    """What an engine reports of itself, recorded with every sample (its ``engine`` field)."""

    engine: EngineKind
    model: NotRequired[str]     # cpu: the model's directory
    url: NotRequired[str | None]   # sglang: its server's base URL
    speculative_algorithm: NotRequired[str]   # sglang: the algorithm it runs, if any


class Engine(Protocol):
    """What a generate worker needs from an engine; ``generate`` runs on the worker's event loop.

    Every engine states all of it: the in-process CPU engine has no server (``url`` and
    ``server`` None), no MTP configuration and no speculative algorithm.
    """

    tokenizer: PreTrainedTokenizerBase   # the target's, loaded by transformers
    mtp: MtpChoice | None   # the MTP configuration it was started in (None: never speculative)
    algorithm: str | None   # the speculative algorithm it runs (SGLang's name), if any
    url: str | None         # its server's base URL (None: in process)
    server: EngineServer | None   # the server this worker started for it, if any
    in_flight: int          # requests it is answering now

    async def generate(self, request: GenRequest) -> GenResult:
        """One completion; concurrent calls are how an engine's batch is kept full."""

    def info(self) -> EngineInfo:
        """A small description recorded with every sample (engine kind, model or server)."""

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
