"""The SGLang client: defensive parsing, retries on 5xx from a real simulator, none on 4xx."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from common.engine.sampling import Sampling
from common.errors import EngineError, RequestRefused
from tests.conftest import free_port, running_simulator
from tests.test_bench import simulator  # noqa: F401 - fixture
from workers.generate.engines.base import GenRequest, ServerLimits, fit_request
from workers.generate.engines.sglang import (
    RetryableEngineError,
    SglangEngine,
    error_message,
    parse_finish_reason,
    parse_response,
    read_limits,
)

REQ = GenRequest(input_ids=[5, 6, 7], sampling=Sampling(max_new_tokens=8))


def test_finish_reason_shapes() -> None:
    assert parse_finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    assert parse_finish_reason({"finish_reason": {"type": "length", "length": 8}}) == "length"
    assert parse_finish_reason({"finish_reason": "length"}) == "length"
    assert parse_finish_reason({"finish_reason": None}) == "abort"
    assert parse_finish_reason({}) == "abort"


def test_response_parsing_is_token_exact_or_refuses() -> None:
    body = {"output_ids": [1, 2, 3], "meta_info": {"finish_reason": {"type": "stop"},
                                                   "prompt_tokens": 3, "completion_tokens": 3}}
    result = parse_response(body, REQ, 0.5)
    assert result.output_ids == [1, 2, 3] and result.finish_reason == "stop"
    with pytest.raises(EngineError, match="output_ids"):
        parse_response({"text": "hi", "meta_info": {}}, REQ, 0.1)
    with pytest.raises(EngineError, match="output_ids"):
        parse_response({"output_ids": ["a", "b"], "meta_info": {}}, REQ, 0.1)
    with pytest.raises(RetryableEngineError):
        parse_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"}}},
                       REQ, 0.1)


def _engine(url: str, window: float = 30) -> SglangEngine:
    return SglangEngine(url, tokenizer=None, max_in_flight=8, request_timeout=30,
                        retry_window=window, stop_ids=[])


def test_5xx_are_retried_until_they_succeed() -> None:
    with running_simulator("--fail-rate", "0.5", "--time-scale", "0.05") as url:
        engine = _engine(url)
        requests = [GenRequest([i, i + 1, i + 2], Sampling(max_new_tokens=16)) for i in range(20)]
        results = asyncio.run(_gather(engine, requests))
        assert len(results) == 20 and all(r.output_ids for r in results)
        stats = _stats(url)
        assert stats["failed"] > 0 and engine.requests == stats["failed"] + 20


async def _gather(engine: SglangEngine, requests: list[GenRequest]) -> list:
    try:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.aclose()


def _stats(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/sim/stats", timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def test_4xx_is_not_retried_and_rejects_only_that_request(simulator: str) -> None:  # noqa: F811
    engine = _engine(simulator)
    with pytest.raises(RequestRefused, match="HTTP 400: input_ids must not be empty") as refused:
        asyncio.run(_gather(engine, [GenRequest([], Sampling())]))
    assert refused.value.reason == "engine_refused"
    assert engine.requests == 1


def test_unreachable_engine_gives_up_after_the_window() -> None:
    engine = _engine(f"http://127.0.0.1:{free_port()}", window=1.0)
    with pytest.raises(EngineError, match="failed for"):
        asyncio.run(_gather(engine, [REQ]))
    assert engine.requests >= 2


def test_counts_that_disagree_with_the_ids_reject_that_sample() -> None:
    def body(ids: list[int], prompt: int, completion: int) -> dict:
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"},
                                                 "prompt_tokens": prompt,
                                                 "completion_tokens": completion}}

    ok = parse_response(body([9, 2], 3, 2), REQ, 0.1)
    assert (ok.prompt_tokens, ok.completion_tokens) == (3, 2)
    # output_ids that begin with the prompt's tokens (sgl-project/sglang#10896): 5 ids, 2 new
    for wrong in (body([5, 6, 7, 9, 2], 3, 2), body([9, 2], 4, 2)):
        with pytest.raises(RequestRefused, match="output ids") as refused:
            parse_response(wrong, REQ, 0.1)
        assert refused.value.reason == "engine_mismatch"


def test_server_limits_are_read_from_sglangs_own_answers() -> None:
    models = {"data": [{"id": "m", "max_model_len": 4096}]}
    info = {"max_req_input_len": 4090,
            "internal_states": [{"effective_max_running_requests_per_dp": 48}]}
    assert read_limits(models, info) == ServerLimits(4096, 4090, 48)
    assert read_limits(models, None) == ServerLimits(4096, 4096, None)
    assert read_limits(None, info) is None and read_limits({"data": []}, info) is None
    assert error_message('{"error": {"message": "top_k must be -1"}}') == "top_k must be -1"
    assert error_message('{"detail": "Not Found"}') == "Not Found"


def test_a_request_is_fitted_to_the_servers_context() -> None:
    limits = ServerLimits(context_length=100, max_input_tokens=95)
    asked = GenRequest(list(range(60)), Sampling(max_new_tokens=64), min_answer_tokens=16)
    assert fit_request(asked, limits)[1] == 40           # capped to the room left
    assert fit_request(asked, None)[1] == 64             # a server stating no context
    short = GenRequest(list(range(10)), Sampling(max_new_tokens=8), min_answer_tokens=16)
    assert fit_request(short, limits)[1] == 8            # asks less than the floor: fine
    for ids in (list(range(90)), list(range(95))):       # 10 left < 16; prompt at the bound
        with pytest.raises(RequestRefused, match="context") as refused:
            fit_request(GenRequest(ids, Sampling(max_new_tokens=64), 16), limits)
        assert refused.value.reason == "context_overflow"
