"""Async client for SGLang's native ``/generate``, with a fixed number of requests in flight.

Requests carry ``input_ids`` (the chat template was applied once by the worker) and come back
with the exact ``output_ids``. Connection errors, timeouts, 5xx and aborted requests are retried
with capped backoff until ``retry_window`` seconds pass, which covers an engine server restart.
The server's own limits are read once (``/v1/models``, ``/get_server_info``): no request asks
for more than its context holds, and the in-flight cap never exceeds its running-request limit.
A 4xx answer, or a response whose counts disagree with its ids, rejects that one sample.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from common.choices import EngineKind, FinishReason, Reason
from common.engine.mtp import MtpChoice
from common.engine.serving import sampling_params
from common.engine.speculative import server_algorithm, spec_figures
from common.errors import EngineError, RequestRefused
from workers.generate.engines.base import (
    EngineInfo,
    GenRequest,
    GenResult,
    ServerLimits,
    fit_request,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from workers.generate.engines.server import EngineServer

log = logging.getLogger(__name__)

_BACKOFF_MAX_S = 10.0
_JSON = {"Content-Type": "application/json"}


class RetryableEngineError(EngineError):
    """The engine is restarting, overloaded or aborted the request: try again."""


def parse_finish_reason(meta: dict[str, Any]) -> FinishReason:
    """SGLang reports ``{"type": "stop"|"length"|"abort", ...}``; older builds a bare string."""
    reason = meta.get("finish_reason")
    return FinishReason.parse(reason.get("type") if isinstance(reason, dict) else reason)


def parse_response(body: Any, request: GenRequest, latency: float) -> GenResult:
    """Turn a ``/generate`` response into a result, refusing anything not token-exact."""
    if not isinstance(body, dict):
        raise EngineError(f"unexpected /generate response: {str(body)[:200]}")
    meta = body.get("meta_info") or {}
    output_ids = body.get("output_ids", meta.get("output_ids"))
    # JSON numbers parse as ints; checking the ends catches a server returning text or floats
    # without a per-token pass on every response.
    if not isinstance(output_ids, list) or (
            output_ids and not (type(output_ids[0]) is int and type(output_ids[-1]) is int)):
        raise EngineError("/generate response has no integer output_ids; SGLang must return "
                          "token ids (input_ids requests do)")
    finish = parse_finish_reason(meta)
    if finish is FinishReason.ABORT:
        raise RetryableEngineError(f"request aborted by the engine: {meta.get('finish_reason')}")
    prompt_tokens = int(meta.get("prompt_tokens", len(request.input_ids)))
    completion_tokens = int(meta.get("completion_tokens", len(output_ids)))
    # Some SGLang builds returned output_ids that begin with prompt tokens: the counts tell.
    if completion_tokens != len(output_ids) or prompt_tokens != len(request.input_ids):
        raise RequestRefused(Reason.ENGINE_MISMATCH,
                             f"the engine answered {len(output_ids)} output ids but "
                             f"completion_tokens {completion_tokens}, prompt_tokens "
                             f"{prompt_tokens} for {len(request.input_ids)} input ids")
    return GenResult(
        output_ids=output_ids,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        latency_s=latency,
        speculative=spec_figures(meta),
    )


def read_limits(models: Any, server_info: Any) -> ServerLimits | None:
    """The server's context, prompt bound and running-request limit from ``/v1/models`` and
    ``/get_server_info`` (SGLang's names), or None when it states no context."""
    models = models.get("data") if isinstance(models, dict) else None
    context = next((m.get("max_model_len") for m in models or [] if isinstance(m, dict)), None)
    if not isinstance(context, int) or context < 2:
        return None
    info = server_info if isinstance(server_info, dict) else {}
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) \
        else {}
    max_input = info.get("max_req_input_len")
    running = state.get("effective_max_running_requests_per_dp",
                        state.get("max_running_requests", info.get("max_running_requests")))
    return ServerLimits(
        context_length=context,
        max_input_tokens=max_input if isinstance(max_input, int) and max_input > 0 else context,
        max_running_requests=running if isinstance(running, int) and running > 0 else None)


def payload(request: GenRequest, stop_ids: list[int],
            max_new_tokens: int | None = None) -> dict[str, Any]:
    max_new = request.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    return {"input_ids": request.input_ids,
            "sampling_params": sampling_params(request.sampling, max_new, stop_ids),
            "stream": False}


def error_message(text: str) -> str:
    """SGLang's ``{"error": {"message": ...}}`` (or FastAPI's ``detail``) as one short line."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text.strip()[:300]
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    detail = body.get("detail") if isinstance(body, dict) else None
    return str(message or detail or body)[:300]


class SglangEngine:
    """An SGLang-protocol server (real or the simulator) behind the engine interface."""

    def __init__(self, url: str, tokenizer: PreTrainedTokenizerBase, max_in_flight: int,
                 request_timeout: float, retry_window: float, stop_ids: list[int],
                 server: EngineServer | None = None, mtp: MtpChoice | None = None) -> None:
        self.url: str | None = url.rstrip("/")
        self.mtp = mtp
        # The speculative algorithm it runs: the launch's, else what the server reports.
        self.algorithm: str | None = mtp.algorithm if mtp is not None else None
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.request_timeout, self.retry_window = request_timeout, retry_window
        self.stop_ids = stop_ids
        self.server = server
        self.in_flight = 0
        self.requests = 0
        self.limits: ServerLimits | None = None
        self._slots: asyncio.Semaphore | None = None
        self._opening: asyncio.Lock | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def info(self) -> EngineInfo:
        info: EngineInfo = {"engine": EngineKind.SGLANG, "url": self.url}
        if self.algorithm:
            info["speculative_algorithm"] = self.algorithm
        return info

    async def _open(self) -> None:
        """The HTTP session, the server's limits and the in-flight slots, once per loop."""
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            connector=aiohttp.TCPConnector(limit=self.max_in_flight),
        )
        self.limits = await self._read_limits()
        running = self.limits.max_running_requests if self.limits else None
        if running is not None and running < self.max_in_flight:
            log.warning("engine %s runs at most %d requests: in-flight cap lowered from %d",
                        self.url, running, self.max_in_flight)
            self.max_in_flight = running
        self._slots = asyncio.Semaphore(self.max_in_flight)

    async def _read_limits(self) -> ServerLimits | None:
        assert self._session is not None
        bodies = []
        for path in ("/v1/models", "/get_server_info"):
            try:
                async with self._session.get(f"{self.url}{path}",
                                             timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    bodies.append(orjson.loads(await resp.read()) if resp.status == 200 else None)
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
                log.warning("engine %s: %s not read: %r", self.url, path, exc)
                bodies.append(None)
        limits = read_limits(*bodies)
        self.algorithm = self.algorithm or server_algorithm(bodies[1])
        if limits is None:
            log.warning("engine %s states no context length: max_new_tokens sent as given",
                        self.url)
        else:
            log.info("engine %s: context %d tokens, prompts under %d, running requests %s",
                     self.url, limits.context_length, limits.max_input_tokens,
                     limits.max_running_requests)
        return limits

    async def aclose(self) -> None:
        """Close the HTTP session (on the loop that made it)."""
        if self._session is not None:
            await self._session.close()
            self._session, self._slots = None, None

    def close(self) -> None:
        if self._session is not None and self._loop is not None and self._loop.is_running():
            closing = asyncio.run_coroutine_threadsafe(self.aclose(), self._loop)
            try:
                closing.result(timeout=5)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("engine %s: HTTP session not closed cleanly: %r", self.url, exc)
        if self.server is not None:
            self.server.stop()

    async def generate(self, request: GenRequest) -> GenResult:
        if self._slots is None:
            self._opening = self._opening or asyncio.Lock()
            async with self._opening:
                if self._slots is None:
                    await self._open()
        assert self._slots is not None
        async with self._slots:
            self.in_flight += 1
            try:
                return await self._with_retries(request)
            finally:
                self.in_flight -= 1

    async def _with_retries(self, request: GenRequest) -> GenResult:
        request, max_new = fit_request(request, self.limits)
        deadline = time.monotonic() + self.retry_window
        attempt = 0
        while True:
            try:
                return await self._post(request, max_new)
            except (TimeoutError, RetryableEngineError, aiohttp.ClientConnectionError) as exc:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise EngineError(f"engine at {self.url} failed for {self.retry_window:.0f}s:"
                                      f" {exc!r}") from exc
                delay = min(_BACKOFF_MAX_S, 0.25 * 2**attempt) * (0.5 + random.random())
                log.warning("engine %s: %r; retry %d in %.1fs", self.url, exc, attempt, delay)
                await asyncio.sleep(delay)

    async def _post(self, request: GenRequest, max_new: int) -> GenResult:
        assert self._session is not None
        started = time.perf_counter()
        self.requests += 1
        async with self._session.post(f"{self.url}/generate", data=orjson.dumps(
                payload(request, self.stop_ids, max_new)), headers=_JSON) as response:
            if response.status >= 500:
                raise RetryableEngineError(f"HTTP {response.status}: "
                                           f"{(await response.text())[:200]}")
            if response.status >= 400:
                message = error_message(await response.text())
                raise RequestRefused(Reason.ENGINE_REFUSED, f"HTTP {response.status}: {message}")
            raw = await response.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"/generate answered with invalid JSON ({exc}): "
                              f"{raw[:200]!r}") from exc
        return parse_response(body, request, time.perf_counter() - started)
