"""Rebuild the run monitor's Redis state from commit summaries, in bounded memory and writes.

The run index (:mod:`common.runs.index`) gives the summaries a chunk of 100 shards at a time,
with the commits it lacks read directly and the parts of uncommitted shards listed; each is
kept only long enough to add it up (uncommitted shards are summarised from their parts).
Redis gets the state in pipelines of at
most :data:`CHUNK` commands, so neither this process nor Redis holds the run at once; the
``ready`` flag, set last, is what lets workers go on. The rebuild only ever adds a pause (storage's,
where Redis has none in force), never removes one: only ``resume`` lifts a pause.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from common import keys
from common.gates.partstats import EXAMPLE_FIELDS, SampleStat
from common.queue import redis_keys
from common.reads import part_getter, rows_or_none
from common.row_caps import RowCaps
from common.runs.commit_cache import THREADS, fetch
from common.runs.index import RunIndex, ScanPlan, shard_total
from common.runs.index_objects import SUMMARIES
from common.runs.schemas import SAMPLE
from common.runs.store import RunStore
from common.runs.summary import RunSummary, answer_order, shard_summary
from common.storage import Storage

log = logging.getLogger(__name__)

CHUNK = 5_000

# Owner of an answer: the earliest judged sample; a side hash keeps each owner's order key.
_CLAIM = """
for i = 1, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 2]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  elseif ARGV[i + 2] < redis.call('HGET', KEYS[2], ARGV[i]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
  end
end
return 0
"""
# The same over one argument of NUL-separated triples: packing 3 arguments per answer costs
# the client more than Redis's work (a seed-sized run has nearly a million answers).
_CLAIM_PACKED = """
for h, owner, rank in string.gmatch(ARGV[1], "([^%z]*)%z([^%z]*)%z([^%z]*)%z") do
  if redis.call('HSETNX', KEYS[2], h, rank) == 1 then
    redis.call('HSET', KEYS[1], h, owner)
  elseif rank < redis.call('HGET', KEYS[2], h) then
    redis.call('HSET', KEYS[1], h, owner)
    redis.call('HSET', KEYS[2], h, rank)
  end
end
return 0
"""


def summary_index(storage: Storage, run: str, threads: int = THREADS) -> RunIndex:
    """The run index's summaries, read in passing (never all kept: answers are large)."""
    return RunIndex(storage, run, SUMMARIES, keep=False, rejected=True, threads=threads)


def shard_summaries(storage: Storage, run: str, threads: int = THREADS,
                    plan: ScanPlan | None = None) -> Iterator[tuple[int, dict[str, Any], bool]]:
    """``(shard, summary, committed)`` for every shard with a commit or a part, chunk by chunk
    from the run index (commits carry their summary; uncommitted shards' parts are read)."""
    index = summary_index(storage, run, threads)
    caps: RowCaps | None = None
    for read in index.scan(plan.total if plan else shard_total(storage, run), plan):
        for shard, summary in sorted(read.entries.items()):
            yield shard, summary, True
        for shard, part_keys in sorted(read.uncommitted_parts().items()):
            caps = caps or RunStore(storage, run).sample_caps
            yield shard, _from_parts(storage, part_keys, threads, caps), False


def _from_parts(storage: Storage, part_keys: list[str], threads: int,
                caps: RowCaps) -> dict[str, Any]:
    """An uncommitted shard's summary from its parts (bounded, typed; a foreign one skipped)."""
    known = {key: [SampleStat.of(s) for s in rows]
             for key, data in fetch(storage, part_keys, threads, get=part_getter(storage))
             if (rows := rows_or_none(storage, key, SAMPLE, data, caps)) is not None}
    return shard_summary(known)


def rebuild_from_summaries(client: redis.Redis, storage: Storage, run: str, *, size: int,
                           accepted_at: int, last_resume: dict[str, Any],
                           pause: dict[str, Any] | None,
                           heartbeat: Callable[[], object] = lambda: None) -> int:
    """Write the monitor's state for ``run``; returns the number of judged samples."""
    started = time.monotonic()
    answers, order = redis_keys.RunKeys(run).answers, redis_keys.RunKeys(run).answers_order
    stale = list(client.scan_iter(redis_keys.RunKeys(run).gate_examples("*"), count=1000))
    # UNLINK: a run's answers hash has a million fields; DEL would block Redis while it frees
    client.unlink(redis_keys.RunKeys(run).gates, redis_keys.RunKeys(run).gate_hist,
                  redis_keys.RunKeys(run).gate_window, answers, order,
                  redis_keys.RunKeys(run).partial, *stale)   # never the pause: only resume lifts
    claim = client.register_script(_CLAIM)
    packed = client.register_script(_CLAIM_PACKED)
    total = RunSummary()
    pipe, queued = client.pipeline(transaction=False), 0
    for shard, summary, committed in shard_summaries(storage, run):
        total.add(shard, summary, committed)
        entries = summary["answers"]
        for first in range(0, len(entries), CHUNK // 3):
            batch = [(e[0], e[1], answer_order(shard, e))
                     for e in entries[first:first + CHUNK // 3]]
            if any("\0" in h or "\0" in owner for h, owner, _ in batch):
                claim(keys=[answers, order], args=[x for e in batch for x in e], client=pipe)
            else:
                packed(keys=[answers, order], client=pipe,
                       args=["".join(f"{h}\0{owner}\0{rank}\0" for h, owner, rank in batch)])
            queued += len(batch)
        if queued >= CHUNK:
            pipe.execute()
            heartbeat()
            pipe, queued = client.pipeline(transaction=False), 0
    pipe.execute()
    client.unlink(order)
    _write_state(client, run, total, size, accepted_at, last_resume, pause)
    log.info("run %s: quality monitor rebuilt from %d judged samples (summaries) in %.1fs",
             run, total.judged, time.monotonic() - started)
    return total.judged


def _write_state(client: redis.Redis, run: str, total: RunSummary, size: int, accepted_at: int,
                 last_resume: dict[str, Any], pause: dict[str, Any] | None) -> None:
    """Counters, histogram, window and examples in chunks; ``ready`` in the last write."""
    gates = redis_keys.RunKeys(run).gates
    since = max(total.judged - accepted_at, 0)
    window = total.window(min(size, since))
    pipe = client.pipeline(transaction=False)
    hist = [(str(t), n) for t, n in sorted(total.hist.items())]
    for first in range(0, len(hist), CHUNK):
        pipe.hset(redis_keys.RunKeys(run).gate_hist, mapping=dict(hist[first:first + CHUNK]))
    for first in range(0, len(window), CHUNK):
        pipe.rpush(redis_keys.RunKeys(run).gate_window, *map(str, window[first:first + CHUNK]))
    for reason in total.examples:
        pipe.rpush(redis_keys.RunKeys(run).gate_examples(reason),
                   *(json.dumps({k: view[k] for k in EXAMPLE_FIELDS})
                     for view in total.newest_examples(reason)))
    if total.partial:
        pipe.hset(redis_keys.RunKeys(run).partial, mapping={keys.shard_name(s): n
                                                            for s, n in total.partial.items()})
    counters: dict[FieldT, EncodableT] = {"checked": total.judged, "rejected": total.rejected,
                                "since": since, "turns": total.turns,
                                "turns_rejected": total.turns_rejected,
                                "thinking_off": total.thinking_off,
                                **{f"reason:{r}": n for r, n in total.reasons.items()}}
    counters.update({name: last_resume[name] for name in ("max_reject_rate", "pause_after")
                     if last_resume.get(name) is not None})
    pipe.hset(gates, mapping=counters)
    if pause is not None:   # storage's pause, added unless Redis has one in force
        redis_keys.push_pause(client, run, pause)
    pipe.hset(gates, "ready", 1)
    pipe.execute()
