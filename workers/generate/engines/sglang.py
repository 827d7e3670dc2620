"""Async client for SGLang's native ``/generate``, with a fixed number of requests in flight.

Requests carry ``input_ids`` (the chat template was applied once by the worker) and come back
with the exact ``output_ids``. Connection errors, timeouts, 5xx and aborted requests are retried
with capped backoff until ``retry_window`` seconds pass, which covers an engine server restart.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import aiohttp
import orjson

from common.errors import EngineError
from workers.generate.engines.base import GenRequest, GenResult

log = logging.getLogger(__name__)

_BACKOFF_MAX_S = 10.0
_JSON = {"Content-Type": "application/json"}


class RetryableEngineError(EngineError):
    """The engine is restarting, overloaded or aborted the request: try again."""


def parse_finish_reason(meta: dict[str, Any]) -> str:
    """SGLang reports ``{"type": "stop"|"length"|"abort", ...}``; older builds a bare string."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length", "abort") else "abort"


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
    if finish == "abort":
        raise RetryableEngineError(f"request aborted by the engine: {meta.get('finish_reason')}")
    return GenResult(
        output_ids=output_ids,
        finish_reason=finish,
        prompt_tokens=int(meta.get("prompt_tokens", len(request.input_ids))),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        latency_s=latency,
    )


def payload(request: GenRequest, stop_ids: list[int]) -> dict[str, Any]:
    sampling = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "skip_special_tokens": False,
    }
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    return {"input_ids": request.input_ids, "sampling_params": params, "stream": False}


class SglangEngine:
    """An SGLang-protocol server (real or the simulator) behind the engine interface."""

    def __init__(self, url: str, tokenizer: Any, max_in_flight: int, request_timeout: float,
                 retry_window: float, stop_ids: list[int], server: Any = None) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.request_timeout, self.retry_window = request_timeout, retry_window
        self.stop_ids = stop_ids
        self.server = server
        self.in_flight = 0
        self.requests = 0
        self._slots: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def info(self) -> dict[str, Any]:
        return {"engine": "sglang", "url": self.url}

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
            self._slots = asyncio.Semaphore(self.max_in_flight)
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                connector=aiohttp.TCPConnector(limit=self.max_in_flight),
            )
        async with self._slots:
            self.in_flight += 1
            try:
                return await self._with_retries(request)
            finally:
                self.in_flight -= 1

    async def _with_retries(self, request: GenRequest) -> GenResult:
        deadline = time.monotonic() + self.retry_window
        attempt = 0
        while True:
            try:
                return await self._post(request)
            except (TimeoutError, RetryableEngineError, aiohttp.ClientConnectionError) as exc:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise EngineError(f"engine at {self.url} failed for {self.retry_window:.0f}s:"
                                      f" {exc!r}") from exc
                delay = min(_BACKOFF_MAX_S, 0.25 * 2**attempt) * (0.5 + random.random())
                log.warning("engine %s: %r; retry %d in %.1fs", self.url, exc, attempt, delay)
                await asyncio.sleep(delay)

    async def _post(self, request: GenRequest) -> GenResult:
        assert self._session is not None
        started = time.perf_counter()
        self.requests += 1
        async with self._session.post(f"{self.url}/generate", data=orjson.dumps(
                payload(request, self.stop_ids)), headers=_JSON) as response:
            if response.status >= 500:
                raise RetryableEngineError(f"HTTP {response.status}: "
                                           f"{(await response.text())[:200]}")
            if response.status >= 400:
                raise EngineError(f"engine refused the request: HTTP {response.status}: "
                                  f"{(await response.text())[:300]}")
            raw = await response.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"/generate answered with invalid JSON ({exc}): "
                              f"{raw[:200]!r}") from exc
        return parse_response(body, request, time.perf_counter() - started)
