"""The real SGLang (the pinned release, CPU, tiny dense target) against our engine side.

One server, started by the product's launcher, serves the module: token-exact output against
the CPU engine's greedy decoding, the limits the server settled on read back, its ``/metrics``
read by the dashboard's probe, and the simulator held to it request for request (the contract:
status codes, error words and response shapes). The end-to-end test lets a generate worker
launch its own server (``--engine sglang --engine-python``) and kills it mid-shard.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from common import keys
from common.engine.sampling import Sampling
from common.storage import open_storage
from tests.conftest import (
    MAX_STRETCH,
    Pipeline,
    call_json,
    free_port,
    running_simulator,
    wait_until,
)
from tests.sglang_real import CONTEXT, engine_env, real_server, require_sglang
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl
from workers.generate.engines.supervisor import SUPERVISOR_MODULE

# One worker process runs them all, one after the other: each server takes a core.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("sglang")]

MAX_RUNNING = 6   # asked of the shared server, read back by the client


@pytest.fixture(scope="session")
def tiny(model_cache: Path) -> Path:
    from embedded.tinymodel import ensure_tiny_model

    return ensure_tiny_model(model_cache)


@pytest.fixture(scope="session")   # one per xdist worker; the group keeps them on one
def sglang_url(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_sglang()
    with real_server(tiny, tmp_path_factory.mktemp("sglang"), free_port(),
                     f"--max-running-requests {MAX_RUNNING}") as url:
        yield url


def _call(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    return call_json(url + path, body)


def _prompts(tiny: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from common.gates.turns import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    return [render_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}], Sampling())
            for row in _mt_bench_rows(n)]


def test_real_server_is_token_exact_and_its_limits_are_read_back(
        sglang_url: str, tiny: Path) -> None:
    from workers.generate.context import stop_token_ids
    from workers.generate.engines.base import GenRequest
    from workers.generate.engines.cpu import CpuEngine
    from workers.generate.engines.sglang import SglangEngine

    greedy = Sampling(max_new_tokens=40, temperature=0.0)
    requests = [GenRequest(ids, greedy) for ids in _prompts(tiny, 3)]
    engine = SglangEngine(sglang_url, None, max_in_flight=16, request_timeout=600,
                          retry_window=60, stop_ids=stop_token_ids(tiny))

    async def both() -> list[Any]:
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    served = asyncio.run(both())
    # The limits the server settled on, read back: no request may ask for more.
    assert engine.limits is not None
    assert (engine.limits.context_length, engine.limits.max_input_tokens) == (CONTEXT, CONTEXT - 6)
    assert engine.limits.max_running_requests == MAX_RUNNING
    assert engine.max_in_flight == MAX_RUNNING          # lowered from 16
    cpu = CpuEngine(tiny, batch_size=1)

    async def reference() -> list[Any]:
        return [await cpu.generate(r) for r in requests]

    for mine, real in zip(asyncio.run(reference()), served, strict=True):
        assert real.output_ids == mine.output_ids       # HF greedy, token for token
        assert real.finish_reason == mine.finish_reason
        assert real.completion_tokens == len(real.output_ids) > 0


def test_real_metrics_feed_the_dashboards_engine_probe(sglang_url: str) -> None:
    import aiohttp

    from common.config import load_settings
    from producer.ui.server import _probe, engine_networks

    networks = engine_networks(load_settings({}).ui.engine_networks)   # loopback among them

    async def probe() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await _probe(session, sglang_url, networks)

    assert asyncio.run(probe()) == {"healthy": True, "running": 0, "queued": 0}


def test_a_stopping_engine_finishes_the_requests_it_runs(tiny: Path, tmp_path: Path) -> None:
    import threading

    answers: list[Any] = []
    with real_server(tiny, tmp_path, free_port(), drain=300 * MAX_STRETCH) as url:
        body = {"input_ids": _prompts(tiny, 1)[0], "stream": False, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
        asking = threading.Thread(target=lambda: answers.append(_call(url, "/generate", body)))
        asking.start()
        wait_until(lambda: "#running-req: 1" in (tmp_path / "engines").joinpath(
            f"engine-{url.rsplit(':', 1)[1]}.log").read_text(), 120, "the request to run")
    # Leaving the block stopped the server: SIGTERM, and it drained before it exited.
    asking.join(timeout=60)
    status, out = answers[0]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    assert out["meta_info"]["completion_tokens"] == 200


def _contract_cases(prompt: list[int], stop_id: int) -> list[tuple[str, dict]]:
    """The requests both servers get: (name, body)."""
    def body(ids: list[int], **params: Any) -> dict:
        return {"input_ids": ids, "sampling_params": {"temperature": 0, **params},
                "stream": False}

    return [
        ("length", body(prompt, max_new_tokens=4)),
        ("stop", body(prompt, max_new_tokens=64, stop_token_ids=[stop_id])),
        ("input too long", body([5] * (CONTEXT - 1), max_new_tokens=1)),
        ("input plus new too long", body(prompt, max_new_tokens=CONTEXT)),
        ("top_k 0", body(prompt, max_new_tokens=4, temperature=0.6, top_k=0)),
        ("top_p 0", body(prompt, max_new_tokens=4, top_p=0)),
        ("greedy top_k 0", body(prompt, max_new_tokens=2, top_k=0)),
    ]


def _shape(status: int, out: Any) -> dict[str, Any]:
    if status != 200:
        return {"status": status, "error": sorted(out), "words": out["error"]["message"][:40]}
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    return {"status": status, "keys": {"text", "output_ids", "meta_info"} <= set(out),
            "finish": sorted(reason), "type": reason["type"],
            "counts": (meta["prompt_tokens"], meta["completion_tokens"] == len(out["output_ids"]))}


def _aborted(url: str, prompt: list[int]) -> tuple[int, Any]:
    """A long request aborted by its rid while it runs (SGLang's /abort_request)."""
    import threading

    answers: list[tuple[int, Any]] = []
    rid = f"abort-{free_port()}"
    body = {"input_ids": prompt, "rid": rid, "stream": False, "sampling_params": {
        "temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}
    asking = threading.Thread(target=lambda: answers.append(_call(url, "/generate", body)))
    asking.start()
    while asking.is_alive():   # an abort before the request arrives is ignored: ask again
        _call(url, "/abort_request", {"rid": rid})
        asking.join(timeout=0.2)
    return answers[0]


def test_the_simulator_answers_as_the_real_server_does(sglang_url: str, tiny: Path) -> None:
    prompt = _prompts(tiny, 1)[0]
    # Slow steps (10 ms) and long replies, so that an abort lands while the request runs.
    with running_simulator("--model-path", str(tiny), "--context-length", str(CONTEXT),
                           "--decode-base-ms", "10", "--len-mu", "7") as sim_url:
        shapes: dict[str, dict[str, Any]] = {}
        for name, url in (("real", sglang_url), ("sim", sim_url)):
            # Each stops at its own first token: the outputs differ, the shapes may not.
            first = _call(url, "/generate", _contract_cases(prompt, -1)[0][1])[1]
            for case, body in _contract_cases(prompt, first["output_ids"][0]):
                shapes.setdefault(case, {})[name] = _shape(*_call(url, "/generate", body))
            shapes.setdefault("abort", {})[name] = _shape(*_aborted(url, prompt))
            shapes.setdefault("limits", {})[name] = (
                _call(url, "/v1/models")[1]["data"][0]["max_model_len"],
                _call(url, "/get_server_info")[1]["max_req_input_len"])
    for case, seen in shapes.items():
        assert seen["real"] == seen["sim"], (case, seen)
    assert shapes["stop"]["real"]["finish"] == ["matched", "type"]
    assert shapes["length"]["real"]["type"] == "length"
    assert shapes["abort"]["real"]["type"] == "abort"
    assert [shapes[c]["real"]["status"] for c in ("input too long", "input plus new too long",
                                                   "top_k 0", "top_p 0")] == [400] * 4


def _engine_tree(port: int) -> list[psutil.Process]:
    """The SGLang server listening on ``port`` and its children (not its supervisor)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "sglang.launch_server" in cmdline and str(port) in cmdline \
                and SUPERVISOR_MODULE not in cmdline:
            try:
                return [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
    return []


def _long_rows(n: int) -> list[dict]:
    """Conversations whose first turn fits the server's context and whose second cannot."""
    words = " ".join(f"item{i} is here." for i in range(54))
    return [{"question_id": f"long-{i}", "turns": [f"Read this list {i}: {words} Which is first?",
                                           "And which one is last, and why?"]}
            for i in range(n)]


def _kill9(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _gone(procs: list[psutil.Process]) -> bool:
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs
                   if psutil.pid_exists(p.pid))


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_worker_on_the_real_engine_commits_rejects_overflow_and_survives_kills(
        pipeline: Pipeline, tiny: Path, tmp_path: Path) -> None:
    require_sglang()
    from transformers import AutoTokenizer

    from common.gates.turns import render_prompt

    long_prompt = len(render_prompt(AutoTokenizer.from_pretrained(tiny), [
        {"role": "user", "content": _long_rows(1)[0]["turns"][0]}], Sampling()))
    assert CONTEXT - 64 - 30 < long_prompt < CONTEXT - 64, long_prompt   # turn 1 fits, 2 not
    rows = _mt_bench_rows(30) + _long_rows(2)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    # Output gates off: greedy 64-token replies of a tiny model are cut and repeat, and a
    # rejected turn 1 would end a conversation before its turn 2 (the overflow) is reached.
    open_gates = [arg for gate in ("truncated", "thinking", "empty_answer", "leakage",
                                   "duplicates") for arg in ("--skip-gate", gate)]
    pipeline.cli("enqueue", "--input", src, "--run", "real", "--shard-size", "4",
                 "--max-new-tokens", "64", "--temperature", "0", "--min-supervised-tokens",
                 "0", *open_gates, check=True)
    port = free_port()
    worker = pipeline.start_worker("real", "--engine", "sglang", "--max-in-flight", "8",
                                   "--engine-python", str(require_sglang()),
                                   **engine_env(port))
    first = wait_until(lambda: _engine_tree(port), 60, "the worker's SGLang server")
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    commits = lambda: sum(storage.exists(keys.generated_commit("real", s))  # noqa: E731
                          for s in range(8))

    def progress() -> int:
        samples = pipeline.read_status("real")["samples"]
        return (samples["done"] or 0) + (samples["in_progress"] or 0)

    # 1. The server and its scheduler crash mid-shard: the worker restarts them.
    wait_until(lambda: progress() >= 1, 900, "a first part")
    _kill9(first)
    assert commits() < 8, "the run ended before the engine's kill"
    wait_until(lambda: [p for p in _engine_tree(port) if p.pid != first[0].pid], 120,
               "the worker to restart its engine")
    # 2. The worker itself is killed mid-run: its engine goes with it, another worker heals.
    wait_until(lambda: commits() >= 2, 900, "two shards committed")
    engine = _engine_tree(port)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert commits() < 8, "the run ended before the worker's kill"
    wait_until(lambda: _gone(engine) and not _engine_tree(port) and not _listening(port), 30,
               "the engine to die with its worker")
    port = free_port()
    heir = pipeline.start_worker("heir", "--engine", "sglang", "--max-in-flight", "8",
                                 **engine_env(port))
    pipeline.wait_done("real", timeout=1800)
    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "real")
    ids = [s["id"] for s in samples]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in rows)
    assert len(ids) == len(set(ids))
    status = pipeline.read_status("real")
    assert status["shards"]["parked"] == 0, status["shards"]
    by_id = {s["id"]: s for s in samples}
    for row in _long_rows(2):   # turn 1 kept and trains, turn 2 never sent (no room)
        quality = by_id[row["question_id"]]["quality"]
        assert quality["passed"] and quality["stopped"]["reasons"] == ["context_overflow"]
        assert not quality["stopped"]["output_ids"] and quality["stopped"]["turn"] == 2
        assert quality["stopped"]["refused"]["reason"] == "context_overflow"
        turns = by_id[row["question_id"]]["turns"]
        assert len(turns) == 1 and turns[0]["output_ids"]
    assert status["gates"]["reasons"].get("context_overflow") == 2, status["gates"]
    # Turn 1 of every conversation as the server returns it, id for id (greedy decoding).
    from workers.generate.context import stop_token_ids
    from workers.generate.engines.server import healthy

    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url), 300, "the heir's engine to be healthy")
    for sample in samples[:3]:
        turn = sample["turns"][0]
        out = _call(url, "/generate", {"input_ids": turn["prompt_ids"], "sampling_params": {
            "temperature": 0, "max_new_tokens": 64, "skip_special_tokens": False,
            "stop_token_ids": stop_token_ids(tiny)}})[1]
        assert turn["output_ids"] == out["output_ids"], sample["id"]
    assert "restarting" in (pipeline.log_dir / "real.log").read_text()
    heir.send_signal(signal.SIGTERM)
    heir.wait(timeout=120)
    wait_until(lambda: not _engine_tree(port), 60, "the engine to stop with its worker")
