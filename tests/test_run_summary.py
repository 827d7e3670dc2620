"""Status, the rebuilt run monitor and the series are the same from commit summaries as from
the parts, on a run written through the project's writers: rejections, duplicate answers, a
pause, two resumes, a redelivered shard with a duplicated sample, and uncommitted shards."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.gates.judge import GateConfig
from common.monitor.run_monitor import rebuild, resume_gates
from common.queue import redis_keys
from common.runs.records import InputManifest, RunConfig, ShardCommit, ShardTask, dumps
from common.storage import LocalStorage
from embedded.reference_monitor import rebuild_from_parts
from producer.status import StatusReader
from producer.ui.series import SeriesReader, build_series
from tests.conftest import RedisServer
from workers.generate.monitor import RunMonitor
from workers.generate.parts import PartBuffer, ShardParts

RUN = "sum"
GATES = GateConfig(pause_after=24, max_reject_rate=0.5)
SHARD = 16


def _sample(shard: int, i: int, passed: bool, answer: str | None = None) -> dict[str, Any]:
    tokens = 90 + i % 7 if passed else 3 + i % 2
    reasons = [] if passed else (["too_few_tokens", "empty_answer"] if i % 3 == 0
                                 else ["too_few_tokens"])
    text = answer if answer is not None else f"answer {shard}-{i}"
    return {"id": f"{shard}-{i}", "messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": text}],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens},
            "finish_reason": "stop",
            "quality": {"passed": passed, "reasons": reasons,
                        "details": [f"turn 1: {r}" for r in reasons],
                        "supervised_tokens": [tokens], "thinking_tokens": [1],
                        "answer_hash": f"h-{text}"}}


class Writer:
    """Writes a shard's samples as a generate worker does: parts of 4, judged by the monitor."""

    def __init__(self, client: Any, storage: LocalStorage) -> None:
        self.client, self.storage = client, storage
        self.pause: dict[str, Any] | None = None

    def write(self, shard: int, samples: list[dict[str, Any]], commit: bool) -> ShardParts:
        monitor = RunMonitor(self.client, self.storage, RUN, GATES)
        monitor.ensure_ready()
        parts = ShardParts(self.storage, ShardTask(RUN, shard))
        parts.refresh()

        def written(accepted: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> None:
            self.pause = monitor.record(accepted, rejected)
            self.client.hincrby(redis_keys.RunKeys(RUN).partial, keys.shard_name(shard),
                                len(accepted) + len(rejected))

        buffer = PartBuffer(parts, 4, 1e9, before_write=monitor.claim_answers,
                            on_write=written, worker=f"w{shard % 2}")
        for sample in samples:
            if sample["id"] not in parts.done_ids:
                buffer.add(sample)
        buffer.flush()
        if commit:
            parts.commit([f"{shard}-{i}" for i in range(SHARD)], f"w{shard % 2}")
            self.client.hdel(redis_keys.RunKeys(RUN).partial, keys.shard_name(shard))
        return parts


def _write_run(client: Any, storage: LocalStorage) -> None:
    config = RunConfig(run=RUN, model="m", input="in.jsonl", format="auto", prompt_field=None,
                       shard_size=SHARD, limit=None, gates=GATES)
    storage.put_once(keys.run_config(RUN), dumps(config.to_json()))
    manifest = InputManifest(shards=6, rows=6 * SHARD, rejected=2, shard_rows=[SHARD] * 6)
    storage.put_once(keys.inputs_manifest(RUN), dumps(manifest.to_json()))
    writer = Writer(client, storage)
    writer.write(0, [_sample(0, i, i % 4 != 0) for i in range(SHARD)], commit=True)
    # Shard 1 goes degenerate: the run pauses part-way, the shard stays uncommitted.
    degenerate = [_sample(1, i, i % 8 == 0) for i in range(SHARD)]
    writer.write(1, degenerate[:12], commit=False)
    assert writer.pause is not None, "the degenerate shard should pause the run"
    resume_gates(client, storage, RUN, GATES, accept=True)
    # A second attempt at shard 1 wrote one of its judged samples again (a later copy).
    copy = ShardParts(storage, ShardTask(RUN, 1))
    again = _sample(1, 3, False)
    again["quality"]["judged_at"] = time.time()
    copy.write([again], rejected=True)
    writer.write(1, degenerate, commit=True)
    resume_gates(client, storage, RUN, GATES, accept=False, max_reject_rate=0.9)
    # Shard 2 repeats answers of shard 0 (the run-wide duplicate gate rejects them).
    writer.write(2, [_sample(2, i, True, "answer 0-1" if i < 3 else None)
                     for i in range(SHARD)], commit=True)
    writer.write(3, [_sample(3, i, i % 2 == 0) for i in range(10)], commit=False)
    writer.write(4, [_sample(4, i, False) for i in range(3)], commit=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    base = tmp_path_factory.mktemp("summary")
    server = RedisServer(base / "redis")
    server.start()
    client = server.client()
    _write_run(client, LocalStorage(str(base / "storage")))
    yield client, base
    server.kill()


def _redis_state(client: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name in sorted(client.scan_iter(f"dflash:{RUN}:*")):
        kind = client.type(name)
        state[name] = {"hash": client.hgetall, "list": lambda n: client.lrange(n, 0, -1),
                       "string": client.get}[kind](name)
    return state


def test_commits_carry_the_summary(run) -> None:
    _, base = run
    commit = ShardCommit.from_json(json.loads(
        LocalStorage(str(base / "storage")).get(keys.generated_commit(RUN, 1))))
    assert commit.summary["judged"] == SHARD and commit.summary["rejected"] > 0
    assert commit.summary["examples"]["too_few_tokens"]


def test_rebuilt_monitor_is_the_same_from_summaries_as_from_parts(run) -> None:
    client, base = run
    storage = LocalStorage(str(base / "storage"))
    live = _redis_state(client)
    client.flushall()
    rebuild_from_parts(client, storage, RUN, GATES)
    reference = _redis_state(client)
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    assert _redis_state(client) == reference
    names = redis_keys.RunKeys(RUN)
    gates = reference[names.gates]
    assert int(gates["checked"]) == 3 * SHARD + 10 + 3 and int(gates["rejected"]) > 10
    assert "1" in reference[names.gate_window]
    assert int(gates["since"]) < int(gates["checked"])  # counted from the accepted pause
    assert reference[names.partial] == {keys.shard_name(3): "10", keys.shard_name(4): "3"}
    assert len(reference[names.answers]) == len(live[names.answers])
    assert reference[names.answers]["h-answer 0-1"] == "0-1"
    examples = [json.loads(x) for x in reference[names.gate_examples("duplicate")]]
    assert [e["id"] for e in examples] == ["2-2", "2-1", "2-0"]  # newest first
    # the live counters too
    for name in (redis_keys.RunKeys(RUN).gates, redis_keys.RunKeys(RUN).gate_hist):
        assert {k: v for k, v in reference[name].items() if k != "ready"} == \
            {k: v for k, v in live[name].items() if k != "ready"}


def _stable(status: dict[str, Any]) -> dict[str, Any]:
    volatile = ("eta_s", "samples_per_s", "tokens", "storage")
    return {k: v for k, v in status.items() if k not in volatile}


def test_status_and_series_are_the_same_from_summaries_as_from_parts(run) -> None:
    client, base = run
    storage = LocalStorage(str(base / "storage"))
    client.flushall()
    wiped = StatusReader(storage, client, RUN).read()  # the monitor lost: counted from storage
    rebuild_from_parts(client, storage, RUN, GATES)
    reference = StatusReader(storage, client, RUN).read()
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    status = StatusReader(storage, client, RUN).read()
    assert _stable(status) == _stable(reference)
    assert status["gates"]["window"]["rejected"] > 0
    assert status["samples"]["in_progress"] == wiped["samples"]["in_progress"] == 13
    assert status["samples"]["done"] == wiped["samples"]["done"] == 3 * SHARD

    from common.gates.partstats import SampleStat, part_stats
    from common.runs.records import decode_jsonl_zst

    entries = []
    for shard in range(5):  # every part read, as the series did before commit summaries
        known = {k: [SampleStat.of(s) for s in decode_jsonl_zst(storage.get(k))]
                 for prefix in (keys.generated_shard_prefix(RUN, shard),
                                keys.rejected_shard_prefix(RUN, shard))
                 for k in storage.list(prefix) if keys.part_number(k) is not None}
        committer = f"w{shard % 2}" if shard < 3 else ""  # a commit names unstamped parts' worker
        entries += [{"shard": shard, **s}
                    for s in part_stats(known, keys.generated_prefix(RUN), committer).values()]
    series = SeriesReader(storage, RUN).read(live=True)   # uncommitted shards' parts too
    assert {k: v for k, v in series.items() if k not in ("run", "train")} == \
        build_series(entries)
    assert series["totals"]["samples"] == 3 * SHARD + 13
