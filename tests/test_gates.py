"""Quality gates on real engine output (the simulator's faulty modes, the CPU model), loss masks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.engine.sampling import Sampling
from common.gates.judge import GateConfig, TokenInfo
from common.runs.records import RunConfig
from common.runs.trainrows import training_rows
from tests.conftest import HYBRID, ROOT, RedisServer, TinyTarget, running_simulator
from workers.generate.engines.base import EngineLoop
from workers.generate.regeneration import Job, ShardCounters, regenerate


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Path:
    from embedded.tinymodel import ensure_tiny_model

    return ensure_tiny_model(model_cache)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def mt_bench_rows(n: int, prefix: str = "q") -> list[dict[str, Any]]:
    lines = (ROOT / "data" / "mt_bench_question.jsonl").read_text().splitlines()[:n]
    return [{"id": f"{prefix}{i}", "source": {},
             "turns": [[{"role": "user", "content": t}] for t in json.loads(line)["turns"]]}
            for i, line in enumerate(lines)]


def run_config(sampling: Sampling, gates: GateConfig) -> RunConfig:
    """A run's frozen config with these sampling values and gates (the rest its defaults)."""
    return RunConfig(run="t", model="m", input="x", sampling=sampling, gates=gates)


def generate(engine: Any, tokenizer: Any, rows: list[dict[str, Any]], *,
             gates: GateConfig | None = None, max_new_tokens: int = 512) -> list[dict]:
    loop = EngineLoop()
    gates = gates or GateConfig()
    job = Job(engine, run_config(Sampling(max_new_tokens=max_new_tokens), gates), 0,
              ShardCounters(), TokenInfo.of(tokenizer))
    try:
        samples = list(regenerate(loop, job, rows))
    finally:
        if hasattr(engine, "aclose"):
            loop.run(engine.aclose())
        loop.stop()
    return sorted(samples, key=lambda s: s["id"])


@pytest.fixture
def simulate(tiny: Path, tokenizer: Any) -> Iterator[Any]:
    """Run rows through a simulator started with the given flags; returns the judged samples."""
    from workers.generate.engines.sglang import SglangEngine

    def run(rows: list[dict], *flags: str, **kw: Any) -> list[dict]:
        with running_simulator("--tokenizer", str(tiny), "--time-scale", "0.01", "--len-mu",
                               "4.5", "--len-sigma", "0.3", *flags) as url:
            engine = SglangEngine(url, tokenizer, 16, 30.0, 5.0,
                                  [tokenizer.convert_tokens_to_ids("<|im_end|>")])
            return generate(engine, tokenizer, rows, **kw)

    yield run


def reasons(samples: list[dict]) -> set[str]:
    return {r for s in samples for r in s["quality"]["reasons"]}


def test_well_formed_replies_pass_every_gate(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(6))
    assert [s["quality"]["passed"] for s in samples] == [True] * 6, reasons(samples)
    for sample in samples:
        quality = sample["quality"]
        assert quality["supervised_tokens"] == [len(t["output_ids"]) for t in sample["turns"]]
        assert all(0 < n < len(t["output_ids"])
                   for n, t in zip(quality["thinking_tokens"], sample["turns"], strict=True))


def test_truncated_replies_are_rejected_with_unclosed_thinking(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(4), max_new_tokens=24)
    for sample in samples:
        assert sample["finish_reason"] == "length"
        assert {"truncated", "thinking_unclosed", "too_few_tokens"} <= set(
            sample["quality"]["reasons"])
        assert not sample["quality"]["passed"]
        assert any("finish_reason length after 24 tokens" in d for d in
                   sample["quality"]["details"])


def test_unclosed_thinking_is_rejected(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(3), "--answer-mode", "unclosed")
    assert all(s["finish_reason"] == "stop" for s in samples)
    assert reasons(samples) == {"thinking_unclosed"}


def test_empty_answer_is_rejected(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(3), "--answer-mode", "empty")
    assert all(s["messages"][-1]["content"] == "" for s in samples)
    assert reasons(samples) == {"empty_answer"}


def test_template_leakage_is_rejected(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(3), "--answer-mode", "leak")
    assert reasons(samples) == {"template_leakage"}
    assert all("special token id" in s["quality"]["details"][0] for s in samples)


def test_six_token_replies_fall_under_the_floor(simulate: Any) -> None:
    samples = simulate(mt_bench_rows(3), "--answer-mode", "degenerate")
    for sample in samples:
        # Judged per turn: the rejected first turn ends the conversation, turn 2 is never sent.
        assert sample["quality"]["supervised_tokens"] == [6] and len(sample["turns"]) == 1
        assert {"too_few_tokens", "thinking_missing"} <= set(sample["quality"]["reasons"])
    # The floor is a threshold: lowered under six tokens, only the missing thinking remains.
    lenient = simulate(mt_bench_rows(2), "--answer-mode", "degenerate",
                       gates=GateConfig(min_supervised_tokens=6))
    assert reasons(lenient) == {"thinking_missing"}


def test_exact_duplicate_answers_across_the_run(simulate: Any, tmp_path: Path) -> None:
    from common.storage import LocalStorage
    from workers.generate.monitor import RunMonitor

    rows = mt_bench_rows(3) + [{**mt_bench_rows(1)[0], "id": "copy-of-q0"}]
    samples = {s["id"]: s for s in simulate(rows)}
    assert samples["q0"]["quality"]["answer_hash"] == samples["copy-of-q0"]["quality"][
        "answer_hash"]
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        monitor = RunMonitor(server.client(), LocalStorage(str(tmp_path / "s")), "dup",
                             GateConfig())
        monitor.claim_answers([samples["q0"], samples["q1"]])
        monitor.claim_answers([samples["q2"], samples["copy-of-q0"]])
        assert samples["copy-of-q0"]["quality"]["reasons"] == ["duplicate"]
        assert "same answer as sample q0" in samples["copy-of-q0"]["quality"]["details"]
        assert all(samples[i]["quality"]["passed"] for i in ("q0", "q1", "q2"))
        # A redelivered sample giving its own answer again is not its own duplicate.
        again = json.loads(json.dumps(samples["q0"]))
        monitor.claim_answers([again])
        assert again["quality"]["passed"]
    finally:
        server.kill()


def test_loss_masks_cover_exactly_the_generated_tokens(tiny: Path, tokenizer: Any) -> None:
    from workers.generate.engines.cpu import CpuEngine

    engine = CpuEngine(tiny, batch_size=4, seed=0)
    samples = generate(engine, tokenizer, mt_bench_rows(4), max_new_tokens=160)
    # A conversation whose second turn the gates rejected keeps its first turn alone.
    assert any(len(sample["turns"]) == 2 for sample in samples)
    for sample in samples:
        rows = training_rows(sample)
        assert len(rows) == len(sample["turns"]) >= 1
        answers = [m for m in sample["messages"] if m["role"] == "assistant"]
        for row, turn, answer in zip(rows, sample["turns"], answers, strict=True):
            mask = row.loss_mask
            assert row.input_ids == turn["prompt_ids"] + turn["output_ids"]
            assert sum(mask) == len(turn["output_ids"]) == turn["completion_tokens"]
            assert mask == [0] * len(turn["prompt_ids"]) + [1] * len(turn["output_ids"])
            supervised = [t for t, m in zip(row.input_ids, mask, strict=True) if m]
            text = tokenizer.decode(supervised, skip_special_tokens=False)
            assert text == tokenizer.decode(turn["output_ids"], skip_special_tokens=False)
            assert answer["content"] in text and answer["reasoning_content"] in text
            if turn["finish_reason"] == "stop":
                assert supervised[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        if len(rows) < 2:
            continue
        # Turn 2's prompt shows turn 1's answer but, as Qwen3 templates do, not its reasoning.
        history = tokenizer.decode(rows[1].input_ids[:rows[1].prompt_tokens])
        assert answers[0]["content"] in history
        if answers[0]["reasoning_content"]:
            assert answers[0]["reasoning_content"] not in history


def test_prompts_that_cannot_fit_the_context_are_rejected_at_enqueue(
        target_model: TinyTarget) -> None:
    from producer.fit import ContextCheck

    tiny = target_model.path   # the hybrid states its context under text_config only
    check = ContextCheck.for_model(tiny, 256, True)
    assert check is not None and check.context == 4096
    short = mt_bench_rows(1)[0]
    assert check(short) is None
    words = " ".join(["island"] * 4000)
    long = {**short, "turns": [[{"role": "user", "content": words}]]}
    reason = check(long)
    assert reason and "prompt too long" in reason and "context of 4096" in reason
    # Room for the answers counts too: a prompt that fits alone can leave too little of it.
    roomy = ContextCheck.for_model(tiny, 2100, True)
    assert roomy(short) is not None and "2 answer(s)" in roomy(short)


def test_enqueue_checks_the_hybrid_targets_nested_context(model_cache: Path,
                                                          tmp_path: Path) -> None:
    """``enqueue`` on tiny-qwen3.5 (context under ``text_config``) rejects a too-long row."""
    import os
    import subprocess
    import sys

    short = mt_bench_rows(1)[0]
    rows = [{"id": "short", "prompt": short["turns"][0][0]["content"]},
            {"id": "long", "prompt": " ".join(["island"] * 4000)}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "DFLASH_MODEL": HYBRID,
           "DFLASH_STORAGE": str(tmp_path / "storage")}
    result = subprocess.run(
        [sys.executable, "-m", "producer.cli", "enqueue", "--run", "ctx", "--input", str(src),
         "--dry-run", "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr   # rows rejected
    assert "does not state its context length" not in result.stderr
    report = json.loads(result.stdout)
    assert (report["rows"], report["rejected"]) == (2, 1)
    assert "prompt too long" in report["examples"][0]["reason"]
    assert "context of 4096" in report["examples"][0]["reason"]


def test_a_turn_that_cannot_fit_the_servers_context_is_not_sent(tiny: Path,
                                                                 tokenizer: Any) -> None:
    from workers.generate.engines.sglang import SglangEngine

    long = {"id": "long", "source": {},
            "turns": [[{"role": "user", "content": "word " * 400}]]}
    counters = ShardCounters()
    with running_simulator("--tokenizer", str(tiny), "--context-length", "300",
                           "--time-scale", "0.01", "--len-mu", "3", "--len-sigma", "0.1") as url:
        engine = SglangEngine(url, tokenizer, 16, 30.0, 5.0,
                              [tokenizer.convert_tokens_to_ids("<|im_end|>")])
        job = Job(engine, run_config(Sampling(max_new_tokens=64),
                                     GateConfig(min_supervised_tokens=0)),
                  0, counters, TokenInfo.of(tokenizer))
        loop = EngineLoop()
        try:
            samples = {s["id"]: s for s in regenerate(loop, job, [*mt_bench_rows(2), long])}
        finally:
            loop.run(engine.aclose())
            loop.stop()
    assert samples["long"]["quality"]["reasons"] == ["context_overflow"]
    assert samples["long"]["turns"][0]["refused"]["reason"] == "context_overflow"
    assert engine.limits is not None and engine.limits.context_length == 300
    # The shard went on, and the count is of requests sent: the refused turn never was.
    sent = [t for s in samples.values() for t in s["turns"]
            if t.get("refused", {}).get("reason") != "context_overflow"]
    assert sent and counters.requests == len(sent) == counters.answered
