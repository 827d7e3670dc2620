"""The SGLang simulator as a real server process: protocol, exactness, batching and throughput."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import wait_until
from tests.simulator_support import (
    Sim,
    launch,
    simulator_starter,  # noqa: F401  (the start fixture)
)

THINK, END_THINK, IM_END = 3, 4, 2  # the built-in vocabulary's fixed ids
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    server = launch(tmp_path_factory.mktemp("sim"), "--max-running", "8", "--time-scale", "0.05",
                    "--enable-metrics")
    yield server
    server.stop()


def test_generate_shape_and_exactness(sim: Sim) -> None:
    status, out = sim.call("/generate", {"input_ids": PROMPT, "rid": "req-1", "stream": False,
                                         "sampling_params": {"max_new_tokens": 8192,
                                                             "temperature": 0.7, "top_p": 0.95,
                                                             "top_k": 20}})
    assert status == 200
    ids, meta = out["output_ids"], out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "req-1" and meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert ids[0] == THINK and ids[-1] == IM_END and END_THINK in ids
    assert meta["completion_tokens"] == len(ids) and meta["prompt_tokens"] == len(PROMPT)
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert out["text"].startswith("<think>") and "</think>\n\n" in out["text"]
    again = sim.generate(PROMPT, max_new_tokens=8192)
    assert again["output_ids"] == ids and again["text"] == out["text"]
    assert sim.generate(PROMPT[:-1], max_new_tokens=8192)["output_ids"] != ids
    batch = sim.call("/generate", {"input_ids": [PROMPT, PROMPT[:-1]],
                                   "sampling_params": {"max_new_tokens": 8192}})[1]
    assert [b["output_ids"] for b in batch] == [
        ids, sim.generate(PROMPT[:-1], max_new_tokens=8192)["output_ids"]]
    # A client's stop id ends decoding at its first occurrence, as in SGLang.
    stopped = sim.generate(PROMPT, max_new_tokens=8192, stop_token_ids=[END_THINK])
    assert stopped["output_ids"] == ids[: ids.index(END_THINK) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": END_THINK}


def test_max_new_tokens_truncates(sim: Sim) -> None:
    full = sim.generate(PROMPT, max_new_tokens=8192)["output_ids"]
    out = sim.generate(PROMPT, max_new_tokens=5)
    assert out["output_ids"] == full[:5] and IM_END not in out["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    empty = sim.generate(PROMPT, max_new_tokens=0)
    assert empty["output_ids"] == [] and empty["meta_info"]["completion_tokens"] == 0


@pytest.mark.parametrize("body", [
    {}, {"input_ids": []}, {"input_ids": [1, "a"]}, {"input_ids": [1.5]}, {"input_ids": [[1], []]},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": ["x"]}},
    {"input_ids": [1], "stream": True}, b"not json",
])
def test_bad_input_is_400(sim: Sim, body: Any) -> None:
    status, out = sim.call("/generate", body)
    assert status == 400 and isinstance(out["error"]["message"], str), out


async def _post_many(url: str, bodies: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(body: dict) -> dict:
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
                return await resp.json()

        return await asyncio.gather(*(one(b) for b in bodies))


def test_batch_cap_is_respected(sim: Sim) -> None:
    bodies = [{"input_ids": [i, *PROMPT], "sampling_params": {"max_new_tokens": 64}}
              for i in range(24)]
    outs = asyncio.run(_post_many(sim.url, bodies))
    assert all(o["meta_info"]["completion_tokens"] > 0 for o in outs)
    stats = sim.call("/sim/stats")[1]
    # Never above the cap (that the cap is reached: the test below, which holds requests open).
    assert 1 <= stats["max_running_seen"] <= 8 and stats["running"] == stats["queued"] == 0


def test_metrics_parse(sim: Sim) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sim.generate(PROMPT, max_new_tokens=16)
    status, text = sim.call("/metrics")
    assert status == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    stats = sim.call("/sim/stats")[1]
    assert samples["sglang:generation_tokens_total"] == stats["generated_tokens"] > 0
    assert samples["sglang:prompt_tokens_total"] == stats["prompt_tokens"] > 0
    assert samples["sglang:num_running_reqs"] == samples["sglang:num_queue_reqs"] == 0
    assert samples["sim_max_running_reqs"] == 8


def test_chat_completions_and_model_info(sim: Sim) -> None:
    status, out = sim.call("/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": "what is two plus two"}],
        "max_tokens": 8192})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] and choice["message"]["reasoning_content"]
    assert "<think>" not in choice["message"]["content"]
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert sim.call("/v1/chat/completions", {"messages": []})[0] == 400
    info = sim.call("/get_model_info")[1]
    assert info["is_generation"] is True and "model_path" in info and "tokenizer_path" in info


def test_tokenizer_ids_are_real(start: Any, model_cache: Path) -> None:
    from tokenizers import Tokenizer

    from embedded.tinymodel import ensure_tiny_model

    model = ensure_tiny_model(model_cache)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    think, end_think, im_end = (tok.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    # SGLang's own flags, as the worker passes them; --model-path doubles as the tokenizer.
    sim = start("--model-path", str(model), "--tp", "1", "--mem-fraction-static", "0.8",
                "--served-model-name", "tiny", "--time-scale", "0.05")
    out = sim.generate(tok.encode("hello there").ids, max_new_tokens=4000)   # the model's 4096
    ids = out["output_ids"]
    assert ids[0] == think and end_think in ids and ids[-1] == im_end
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": im_end}
    assert out["text"] == tok.decode(ids, skip_special_tokens=True)
    assert sim.call("/get_model_info")[1]["tokenizer_path"] == str(model)


@pytest.mark.parametrize("tokenizer", [False, True], ids=["builtin", "tokenizer"])
def test_degenerate_mode_gives_six_tokens(start: Any, request: pytest.FixtureRequest,
                                          tokenizer: bool) -> None:
    extra, end = [], IM_END
    if tokenizer:
        from tokenizers import Tokenizer

        from embedded.tinymodel import ensure_tiny_model

        model = ensure_tiny_model(request.getfixturevalue("model_cache"))
        extra = ["--tokenizer", str(model)]
        end = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<|im_end|>")
    sim = start("--answer-mode", "degenerate", "--time-scale", "0.05", *extra)
    out = sim.generate(PROMPT, max_new_tokens=4000)
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 6
    assert out["output_ids"][-1] == end
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}
    if not tokenizer:
        assert out["text"] == "thinking\n\n response\nOK."


def test_fail_rate_and_startup_delay(start: Any) -> None:
    sim = start("--fail-rate", "1.0", "--startup-delay", "3", healthy=False)
    assert sim.health() == 503  # the delay counts from when the server starts listening
    wait_until(lambda: sim.health() == 200, 20, "the startup delay to pass", interval=0.05)
    for path, body in (("/generate", {"input_ids": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, out = sim.call(path, body)
        assert status == 500 and "error" in out
    assert sim.call("/sim/stats")[1]["failed"] == 2


def test_sigterm_answers_in_flight_requests_with_abort(start: Any) -> None:
    sim = start("--len-mu", "9", "--len-sigma", "0.01")  # ~8000 tokens: 16 s at full time

    async def scenario() -> dict:
        async with aiohttp.ClientSession() as session:
            pending = asyncio.ensure_future(session.post(
                sim.url + "/generate", json={"input_ids": PROMPT,
                                             "sampling_params": {"max_new_tokens": 20000}}))
            deadline = time.monotonic() + 60
            while sim.call("/sim/stats")[1]["generated_tokens"] < 10:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            sim.proc.send_signal(signal.SIGTERM)
            async with await pending as resp:
                assert resp.status == 200
                return await resp.json()

    out = asyncio.run(scenario())
    assert sim.proc.wait(timeout=10) == 0
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 10 <= len(out["output_ids"]) == out["meta_info"]["completion_tokens"] < 8000


async def _hold_open(url: str, levels: dict[int, tuple[int, int]]) -> dict[int, dict]:
    """Open long requests up to each level in turn; the server's counters once they read the
    (running, queued) expected at that level, or as they were when it gave up waiting."""
    seen = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def stats() -> dict:
            async with session.get(url + "/sim/stats") as resp:
                return await resp.json()

        async def client(i: int) -> None:
            body = {"input_ids": [i, *PROMPT], "sampling_params": {"max_new_tokens": 20000}}
            async with session.post(url + "/generate", json=body) as resp:
                await resp.read()

        tasks: list[asyncio.Task] = []
        for count, expected in levels.items():
            tasks += [asyncio.create_task(client(i)) for i in range(len(tasks), count)]
            deadline = time.monotonic() + 60
            while ((s := await stats())["running"], s["queued"]) != expected \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            seen[count] = s
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return seen


def test_requests_run_together_up_to_the_cap_then_queue(start: Any) -> None:
    # Every running request emits a token per step, so throughput grows with the requests
    # running and is flat once the cap holds the rest in the queue (tok/s figures:
    # benchmarks/simulator_throughput.py). Steps of ~0.2 s and ~8000-token answers keep every
    # request in flight for the whole test, however slow the machine.
    sim = start("--max-running", "64", "--time-scale", "100", "--len-mu", "9",
                "--len-sigma", "0.01")
    levels = {4: (4, 0), 32: (32, 0), 64: (64, 0), 256: (64, 192)}
    seen = asyncio.run(_hold_open(sim.url, levels))
    assert {n: (s["running"], s["queued"]) for n, s in seen.items()} == levels, seen
    assert seen[256]["max_running_seen"] == 64 and seen[256]["completed"] == 0


def test_the_simulator_refuses_what_sglang_refuses(start: Any) -> None:
    # SGLang's own limits and words (tests/test_sglang_real.py compares them with the server).
    sim = start("--context-length", "64", "--time-scale", "0.05", "--max-running", "5")
    assert sim.call("/v1/models")[1]["data"][0]["max_model_len"] == 64
    info = sim.call("/get_server_info")[1]
    assert info["max_req_input_len"] == 58
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 5
    assert sim.call("/metrics")[0] == 404                       # no --enable-metrics
    for body, words in [
            ({"input_ids": list(range(1, 59))}, "Input length (58 tokens) exceeds"),
            ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 63}},
             "Requested token count exceeds the model's maximum context length of 64"),
            ({"input_ids": [1, 2], "sampling_params": {"temperature": 0.6, "top_k": 0}},
             "top_k must be -1 (disable) or at least 1, got 0."),
            ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]")]:
        status, out = sim.call("/generate", body)
        assert status == 400 and words in out["error"]["message"], (body, out)
    greedy = {"input_ids": [1, 2], "sampling_params": {"temperature": 0, "top_k": 0,
                                                       "max_new_tokens": 62}}
    assert sim.call("/generate", greedy)[0] == 200              # greedy replaces top_k
