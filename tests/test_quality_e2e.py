"""The seed's failure for real: 87% six-token replies pause the run before its 200th sample."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common import keys
from common.queue import redis_keys
from common.runs.records import decode_jsonl_zst
from common.storage import open_storage
from tests.conftest import MT_BENCH, Pipeline, running_simulator, wait_until

pytestmark = pytest.mark.e2e


def _variants(path: Path, n: int) -> str:
    """``n`` distinct two-turn prompts made from the MT-Bench questions."""
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    with path.open("w") as fh:
        for i in range(n):
            q = questions[i % len(questions)]
            fh.write(json.dumps({"question_id": f"v{i}", "category": q["category"],
                                 "turns": [f"{q['turns'][0]} (variant {i})", q["turns"][1]]})
                     + "\n")
    return str(path)


@contextmanager
def degenerate_engine(pipeline: Pipeline, model_cache: Path, rate: float,
                      time_scale: float = 0.02) -> Iterator[str]:
    """The simulator giving ``rate`` of prompts six-token replies, and a worker on it."""
    from embedded.tinymodel import ensure_tiny_model

    tiny = ensure_tiny_model(model_cache)
    with running_simulator("--tokenizer", str(tiny), "--time-scale", str(time_scale),
                           "--len-mu", "4.5", "--len-sigma", "0.3", "--answer-mode", "degenerate",
                           "--answer-mode-rate", str(rate)) as url:
        pipeline.start_worker("gen", "--engine", "sglang", "--engine-url", url,
                              "--concurrency", "2")
        yield url


def test_degenerate_replies_pause_the_run_with_the_reason(pipeline: Pipeline, tmp_path: Path,
                                                          model_cache: Path) -> None:
    with degenerate_engine(pipeline, model_cache, 0.87):
        pipeline.cli("enqueue", "--input", _variants(tmp_path / "in.jsonl", 400), "--run", "seed",
                     "--shard-size", "20", check=True)
        wait_until(lambda: pipeline.state("seed") == "paused", 120, "the run to pause")
        status = pipeline.status("seed")
        assert status["state"] == "paused"
        assert "rejected" in status["reason"] and "too_few_tokens" in status["reason"]
        assert status["pause"]["checked"] < 200 and len(status["pause"]["examples"]) == 3
        assert all("too_few_tokens" in e["reasons"] for e in status["pause"]["examples"])
        # Shards in flight stop at their next part and no new one starts: nothing moves.
        wait_until(lambda: not status_running(pipeline), 60, "in-flight shards to stop")
        stopped = pipeline.status("seed")["gates"]["checked"]
        assert stopped < 200
        text = pipeline.cli("status", "--run", "seed", check=True).stdout
        assert "PAUSED" in text and "--accept-gates" in text

        report = json.loads(pipeline.cli("report", "--run", "seed", "--json", check=True).stdout)
        hist = report["supervised_tokens"]
        assert hist["mode"] == 6
        six = next(b for b in hist["histogram"] if b["lo"] == 6)
        assert six["count"] == hist["mode_count"] == max(b["count"] for b in hist["histogram"])
        # Every rejection is a six-token turn: a conversation's first (rejected whole) or a
        # later one (the conversation kept up to it).
        stopped = report["turns"]["stopped_conversations"]
        assert report["reasons"]["too_few_tokens"] == report["samples"]["rejected"] + stopped
        assert report["turns"]["rejected"] == report["samples"]["rejected"] + stopped
        assert report["paused"]["reason"] == status["pause"]["reason"]
        storage = open_storage(pipeline.env["DFLASH_STORAGE"])
        pngs = list(storage.list("runs/seed/reports/"))
        assert len(pngs) == 1 and report["png"].endswith(pngs[0])
        assert storage.get(pngs[0])[:4] == b"\x89PNG"
        # No rejected sample ever lands among the generated (trainable) ones.
        for key in storage.list(keys.generated_prefix("seed")):
            if keys.part_number(key) is not None:
                assert all(s["quality"]["passed"] for s in decode_jsonl_zst(storage.get(key)))

        refused = pipeline.cli("resume", "--run", "seed")
        assert refused.returncode == 1 and "--accept-gates" in refused.stderr
        pipeline.cli("resume", "--run", "seed", "--accept-gates", check=True)
        wait_until(lambda: pipeline.read_status("seed")["gates"]["checked"] > stopped, 60,
                   "generation to continue after --accept-gates")
        # The failure goes on, so the monitor, counting afresh, pauses the run again.
        wait_until(lambda: pipeline.state("seed") == "paused", 120, "the run to pause again")


def status_running(pipeline: Pipeline) -> bool:
    client = __import__("redis").Redis.from_url(pipeline.env["DFLASH_BROKER_URL"])
    return bool(list(client.scan_iter(redis_keys.StageKeys("seed", "generate").lease_pattern)))
