"""The run monitor on a real Redis: pause rule, pause record, rebuild from storage, resume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.errors import RunPaused
from common.gates.judge import GateConfig
from common.gates.partstats import SampleStat
from common.monitor.run_monitor import pause_from_storage, resume_gates
from common.queue import redis_keys
from common.runs.records import ShardCommit, decode_jsonl_zst, dumps, encode_jsonl_zst
from common.runs.summary import shard_summary
from common.storage import LocalStorage
from tests.conftest import RedisServer
from workers.generate.monitor import RunMonitor, pause_reason


def sample(i: int, passed: bool, tokens: int) -> dict[str, Any]:
    reasons = [] if passed else ["too_few_tokens"]
    return {"id": f"s{i}", "messages": [{"role": "assistant", "content": f"answer {i}"}],
            "quality": {"passed": passed, "reasons": reasons,
                        "details": [] if passed else [f"turn 1: {tokens} supervised tokens < 32"],
                        "supervised_tokens": [tokens], "thinking_tokens": [0],
                        "answer_hash": f"h{i}"}}


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Any, LocalStorage]]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server.client(), LocalStorage(str(tmp_path / "storage"))
    server.kill()


def test_pause_rule() -> None:
    # Before the window is full: pause once the rate at the window's end cannot stay under.
    assert pause_reason([1] * 40, 40, 0.2, 200) is None
    assert "41 of the first 41" in pause_reason([1] * 41, 41, 0.2, 200)
    # A full window: the rolling rate over the newest samples decides.
    assert pause_reason([0] * 160 + [1] * 40, 500, 0.2, 200) is None
    assert "21%" in pause_reason([1] * 42 + [0] * 158, 500, 0.2, 200)
    assert pause_reason([1] * 200, 500, 1.0, 200) is None


def test_degenerate_stream_pauses_before_200_samples_and_survives_a_redis_wipe(env) -> None:
    client, storage = env
    gates = GateConfig()
    monitor = RunMonitor(client, storage, "r", gates)
    monitor.ensure_ready()
    pause, written = None, 0
    for part in range(25):  # parts of 8, 7 in 8 rejected (the seed's 87%)
        batch = [sample(part * 8 + j, j == 0, 120 if j == 0 else 6) for j in range(8)]
        storage.put_once(keys.generated_part("r", 0, part), encode_jsonl_zst(batch[:1]))
        storage.put_once(keys.rejected_part("r", 0, part), encode_jsonl_zst(batch[1:]))
        written += len(batch)
        pause = monitor.record(batch[:1], batch[1:])
        if pause:
            break
    assert pause is not None and written < 200
    assert pause["rejected"] > 40 and "rejected" in pause["reason"]
    assert "too_few_tokens" in pause["reason"] and len(pause["examples"]) == 3
    assert client.hget(redis_keys.RunKeys("r").gate_hist, "6") == str(pause["rejected"])
    assert pause_from_storage(storage, "r")["reason"] == pause["reason"]
    with pytest.raises(RunPaused):
        monitor.check()

    before = client.hgetall(redis_keys.RunKeys("r").gates)
    client.flushall()  # Redis lost everything: the next worker rebuilds from storage
    RunMonitor(client, storage, "r", gates).ensure_ready()
    after = client.hgetall(redis_keys.RunKeys("r").gates)
    assert {k: after[k] for k in ("checked", "rejected", "reason:too_few_tokens")} == \
        {k: before[k] for k in ("checked", "rejected", "reason:too_few_tokens")}
    assert monitor.paused()["reason"] == pause["reason"]

    with pytest.raises(RunPaused, match="--accept-gates"):
        resume_gates(client, storage, "r", gates, accept=False)
    record = resume_gates(client, storage, "r", gates, accept=True)
    assert record["accepted"] and monitor.paused() is None
    assert pause_from_storage(storage, "r") is None
    # The monitor keeps watching: the same failure pauses again, counted from the acceptance.
    again = None
    for part in range(25, 40):
        batch = [sample(part * 8 + j, False, 6) for j in range(8)]
        again = monitor.record([], batch)
        if again:
            break
    assert again is not None and (part - 25 + 1) * 8 < 200
    assert json.loads(client.lindex(redis_keys.RunKeys("r").pauses, 0))["at"] > pause["at"]


def test_new_threshold_lifts_the_pause_and_sticks(env) -> None:
    client, storage = env
    monitor = RunMonitor(client, storage, "t", GateConfig(pause_after=10))
    monitor.ensure_ready()
    assert monitor.record([], [sample(i, False, 6) for i in range(5)]) is not None
    resume_gates(client, storage, "t", monitor.gates, accept=False, max_reject_rate=1.0)
    assert monitor.thresholds().max_reject_rate == 1.0
    assert monitor.record([], [sample(i, False, 6) for i in range(5, 30)]) is None
    client.flushall()
    monitor.ensure_ready()
    assert monitor.thresholds().max_reject_rate == 1.0 and monitor.paused() is None


def commit_shard(storage: LocalStorage, run: str, shard: int) -> None:
    """A shard's commit as a worker writes it: its parts' summary (what a rebuild reads)."""
    parts = [k for prefix in (keys.generated_prefix(run), keys.rejected_prefix(run))
             for k in storage.list(prefix) if keys.shard_of(k) == shard]
    known = {k: [SampleStat.of(s) for s in decode_jsonl_zst(storage.get(k))] for k in parts}
    commit = ShardCommit(run, shard, sorted(parts), [], {}, {}, "w", summary=shard_summary(known))
    storage.put_once(keys.generated_commit(run, shard), dumps(commit.to_json()))


def test_rebuild_after_a_wipe_keeps_the_window_in_judgement_order(env) -> None:
    """Rejections spread through a run (50 of 600, 8%) must not crowd the rebuilt window."""
    client, storage = env
    monitor = RunMonitor(client, storage, "w", GateConfig())
    monitor.ensure_ready()
    judged_at, i = 1_000.0, 0
    for part in range(25):
        for shard in range(3):  # three shards written in turn, as three workers would
            batch = []
            for _ in range(8):
                batch.append(sample(i, i % 12 != 5, 6 if i % 12 == 5 else 120))
                i += 1
            judged_at += 1.0
            for s in batch:
                s["quality"]["judged_at"] = judged_at
            accepted = [s for s in batch if s["quality"]["passed"]]
            rejected = [s for s in batch if not s["quality"]["passed"]]
            storage.put_once(keys.generated_part("w", shard, part), encode_jsonl_zst(accepted))
            if rejected:
                storage.put_once(keys.rejected_part("w", shard, part), encode_jsonl_zst(rejected))
            assert monitor.record(accepted, rejected) is None
    commit_shard(storage, "w", 0)  # shard 0 committed, 1 and 2 not
    window = client.lrange(redis_keys.RunKeys("w").gate_window, 0, -1)
    before = client.hgetall(redis_keys.RunKeys("w").gates)
    assert int(before["rejected"]) == 50 and len(window) == 200

    client.flushall()
    monitor.ensure_ready()
    assert client.lrange(redis_keys.RunKeys("w").gate_window, 0, -1) == window
    assert monitor.paused() is None
    after = client.hgetall(redis_keys.RunKeys("w").gates)
    assert (after["checked"], after["rejected"]) == (before["checked"], before["rejected"])
    assert client.hgetall(redis_keys.RunKeys("w").partial) == {keys.shard_name(1): "200",
                                                               keys.shard_name(2): "200"}
    # The window keeps judging: a healthy stream after the wipe does not pause either.
    assert monitor.record([sample(10_000 + j, True, 120) for j in range(8)], []) is None
