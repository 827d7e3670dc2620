"""The run monitor's rebuild before commit summaries: every part of the run read, one transaction.

Kept as the reference that tests and ``benchmarks/seed_scale.py`` compare
:func:`common.monitor.run_monitor.rebuild` with; workers no longer call it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import redis

from common import keys
from common.gates.judge import GateConfig
from common.monitor.run_monitor import Samples, count_samples, resume_state
from common.queue import redis_keys
from common.queue.redis_keys import push_pause
from common.runs.records import decode_jsonl_zst
from common.storage import Storage

log = logging.getLogger(__name__)

REBUILD_CHUNK = 10_000


def judged_samples(storage: Storage, run: str) -> tuple[Samples, dict[int, int]]:
    """Every stored sample once, slimmed to what the monitor counts, in the order the gates
    judged them (part write time, then accepted before rejected as :meth:`RunMonitor.record`
    counts a part); and the samples already in parts of each uncommitted shard."""
    committed: set[int] = set()
    part_keys = []
    for prefix in (keys.generated_prefix(run), keys.rejected_prefix(run)):
        for key in storage.list(prefix):
            shard = keys.commit_shard(key)
            if shard is not None:
                committed.add(shard)
            elif keys.part_number(key) is not None:
                part_keys.append(key)
    judged: list[Any] = []
    for key in sorted(part_keys):
        for sample in decode_jsonl_zst(storage.get(key)):
            if "quality" in sample:
                quality = sample["quality"]
                order = (quality.get("judged_at", 0.0), not quality["passed"], len(judged))
                judged.append((order, keys.shard_of(key), _slim(sample)))
    judged.sort(key=lambda entry: entry[0])
    seen: set[str] = set()
    samples: Samples = []
    partial: Counter[int] = Counter()
    for _, shard, sample in judged:
        if sample["id"] not in seen:
            seen.add(sample["id"])
            samples.append(sample)
            if shard not in committed:
                partial[shard] += 1
    return samples, dict(partial)


def _slim(sample: dict[str, Any]) -> dict[str, Any]:
    """What counting needs of a sample; the last answer only for rejected ones (examples)."""
    quality = sample["quality"]
    slim = {"id": sample["id"], "quality": {k: quality[k] for k in
                                            ("passed", "reasons", "supervised_tokens")}}
    for name in ("answer_hash", "turns_passed", "thinking", "stopped"):
        slim["quality"][name] = quality.get(name)
    if not quality["passed"]:
        slim["quality"]["details"] = quality.get("details", [])[:3]
        answers = [m for m in sample.get("messages", []) if m.get("role") == "assistant"]
        last = (answers[-1].get("content") or "")[:200] if answers else ""
        slim["messages"] = [{"role": "assistant", "content": last}]
    return slim


def rebuild_from_parts(client: redis.Redis, storage: Storage, run: str,
                       gates: GateConfig) -> None:
    """The rebuild before commit summaries: every part read, one transaction (the reference
    that tests and the seed-scale benchmark compare :func:`rebuild` with)."""
    started = time.monotonic()
    events, last, size, accepted_at = resume_state(storage, run, gates)
    samples, partial = judged_samples(storage, run)
    names = [redis_keys.RunKeys(run).gates, redis_keys.RunKeys(run).gate_hist,
             redis_keys.RunKeys(run).gate_window, redis_keys.RunKeys(run).answers,
             redis_keys.RunKeys(run).partial,   # never the pause: only resume lifts it
             *(redis_keys.RunKeys(run).gate_examples(r) for r in _reasons(samples))]
    pipe = client.pipeline(transaction=True)
    pipe.delete(*names)
    for first in range(0, len(samples), REBUILD_CHUNK):  # in judgement order, list kept short
        count_samples(pipe, run, samples[first:first + REBUILD_CHUNK], size)
    for sample in samples:
        if sample["quality"]["passed"] and sample["quality"]["answer_hash"]:
            pipe.hsetnx(redis_keys.RunKeys(run).answers, sample["quality"]["answer_hash"],
                        sample["id"])
    if partial:
        pipe.hset(redis_keys.RunKeys(run).partial, mapping={keys.shard_name(s): n
                                                            for s, n in partial.items()})
    since = max(len(samples) - accepted_at, 0)
    pipe.hset(redis_keys.RunKeys(run).gates, "since", since)
    if since == 0:
        pipe.delete(redis_keys.RunKeys(run).gate_window)
    elif since < size:  # the window only holds samples judged since the last acceptance
        pipe.ltrim(redis_keys.RunKeys(run).gate_window, 0, since - 1)
    for field_name in ("max_reject_rate", "pause_after"):
        if last.get(field_name) is not None:
            pipe.hset(redis_keys.RunKeys(run).gates, field_name, last[field_name])
    if events and events[-1][0] == "pause":   # added unless Redis has one in force
        push_pause(client, run, events[-1][1])
    pipe.hset(redis_keys.RunKeys(run).gates, "ready", 1)
    pipe.execute()
    log.info("run %s: quality monitor rebuilt from %d stored samples in %.1fs", run, len(samples),
             time.monotonic() - started)


def _reasons(samples: Samples) -> set[str]:
    return {r for s in samples for r in s["quality"]["reasons"]} | {
        r for s in samples for r in (s["quality"].get("stopped") or {}).get("reasons", ())}
