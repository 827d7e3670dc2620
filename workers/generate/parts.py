"""A shard's parts: what is already written, writing new ones, and the commit.

Samples that passed the gates go to ``generated/shard-N/part-M``, rejected ones to
``rejected/shard-N/part-M``. Parts are put-once objects; a shard can hold parts from several
attempts (a worker killed mid-shard, a redelivery). The commit lists exactly one canonical copy
of every input sample: generated parts, then rejected parts, each in key order; the first part
holding an id wins.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.errors import StorageError
from common.gates.partstats import SampleStat, part_stats, written_stamp
from common.reads import rows_or_none
from common.row_caps import RowCaps
from common.runs.index_extend import index_after_commit
from common.runs.records import ShardCommit, ShardTask, dumps, encode_jsonl_zst
from common.runs.schemas import SAMPLE
from common.runs.store import RunStore
from common.runs.summary import shard_summary
from common.storage import Storage

log = logging.getLogger(__name__)


def _part_key(task: ShardTask, rejected: bool, number: int) -> str:
    make = keys.rejected_part if rejected else keys.generated_part
    return make(task.run, task.shard, number)


@dataclass
class ShardParts:
    storage: Storage
    task: ShardTask
    known: dict[str, list[SampleStat]] = field(default_factory=dict)
    cap: RowCaps | None = None   # what a part of the run holds (None: the read defaults)

    def refresh(self) -> None:
        """Read every part written so far that this object has not seen yet."""
        run, shard = self.task.run, self.task.shard
        for prefix in (keys.generated_shard_prefix(run, shard),
                       keys.rejected_shard_prefix(run, shard)):
            for key in self.storage.list(prefix):
                if keys.part_number(key) is not None and key not in self.known:
                    # A foreign part (noted) holds no sample: its number stays taken.
                    samples = rows_or_none(self.storage, key, SAMPLE, cap=self.cap) or []
                    self.known[key] = [SampleStat.of(s) for s in samples]

    @property
    def done_ids(self) -> set[str]:
        return {stat.id for stats in self.known.values() for stat in stats}

    def next_part(self, rejected: bool) -> int:
        prefix = _part_key(self.task, rejected, 0).rsplit("/", 1)[0]
        numbers = [keys.part_number(k) for k in self.known if k.startswith(prefix)]
        return max((n for n in numbers if n is not None), default=-1) + 1

    def write(self, samples: list[dict[str, Any]], rejected: bool = False) -> str:
        """Write ``samples`` as the next free part number of their area; returns its key."""
        data = encode_jsonl_zst(samples)
        number = self.next_part(rejected)
        while True:
            key = _part_key(self.task, rejected, number)
            if self.storage.put_once(key, data) or self._own_write(key, data):
                self.known[key] = [SampleStat.of(s) for s in samples]
                return key
            # Another attempt wrote this number meanwhile; the commit dedups, so just move on.
            log.warning("run %s shard %d: part %d written by another attempt, trying the next",
                        self.task.run, self.task.shard, number)
            number += 1

    def _own_write(self, key: str, data: bytes) -> bool:
        """A 412 on bytes equal to ours: our own retried PUT had landed (a lost response)."""
        if self.storage.get(key, limit=len(data)) != data:   # never more than ours is read
            return False
        log.info("run %s shard %d: %s already holds this write (a retried PUT had landed)",
                 self.task.run, self.task.shard, key.rsplit("/", 1)[-1])
        return True

    def commit(self, expected: list[str], worker: str) -> ShardCommit:
        """Write ``_COMMIT.json`` over the canonical samples; an existing commit wins."""
        self.refresh()
        part_of: dict[str, str] = {}
        chosen: dict[str, SampleStat] = {}
        wanted = set(expected)
        generated = keys.generated_prefix(self.task.run)
        # Generated parts before rejected ones, each area in key order: first part wins.
        for key in sorted(self.known, key=lambda k: (not k.startswith(generated), k)):
            for stat in self.known[key]:
                if stat.id in wanted and stat.id not in part_of:
                    part_of[stat.id] = key
                    chosen[stat.id] = stat
        missing = [i for i in expected if i not in part_of]
        if missing:
            raise StorageError(f"shard {self.task.shard}: {len(missing)} samples missing "
                               f"from parts, e.g. {missing[:3]}")
        commit = ShardCommit(
            run=self.task.run, shard=self.task.shard,
            parts=sorted(set(part_of.values())),
            sample_ids=[i for i in expected if part_of[i].startswith(generated)],
            rejected_ids=[i for i in expected if not part_of[i].startswith(generated)],
            part_of=part_of, stats=_stats(list(chosen.values())), worker=worker,
            part_stats=part_stats(self.known, generated, worker),
            summary=shard_summary(self.known),
        )
        key, data = keys.generated_commit(self.task.run, self.task.shard), dumps(commit.to_json())
        if self.storage.put_once(key, data) or self._own_write(key, data):
            index_after_commit(self.storage, self.task.run, self.task.shard)
            return commit
        log.info("run %s shard %d: already committed by another worker", self.task.run,
                 self.task.shard)
        return RunStore(self.storage, self.task.run).commit(self.task.shard)


def _stats(chosen: list[SampleStat]) -> dict[str, Any]:
    return {
        "samples": len(chosen),
        "prompt_tokens": sum(s.prompt_tokens for s in chosen),
        "completion_tokens": sum(s.completion_tokens for s in chosen),
        "finish_reasons": dict(Counter(s.finish_reason for s in chosen)),
        "rejected": sum(1 for s in chosen if s.reasons),
        "rejections": dict(Counter(r for s in chosen for r in s.reasons)),
        # The accepted samples' training rows, (tokens, generated tokens) each: what
        # plan-training --run plans for, without reading the parts.
        "rows": sorted(list(row) for s in chosen if not s.reasons for row in s.rows),
    }


Samples = list[dict[str, Any]]


class PartBuffer:
    """Collects finished samples and writes a part every N samples or T seconds.

    ``before_write`` may reject more samples (the run-wide duplicate check) before the split into
    a generated and a rejected part; ``on_write(accepted, rejected)`` sees what was written.
    Every sample is stamped with ``worker``, the write time and the part's wall time.
    """

    def __init__(self, parts: ShardParts, max_samples: int, max_seconds: float,
                 before_write: Callable[[Samples], None],
                 on_write: Callable[[Samples, Samples], None], worker: str = "") -> None:
        self.parts, self.max_samples, self.max_seconds = parts, max_samples, max_seconds
        self.before_write, self.on_write, self.worker = before_write, on_write, worker
        self.buffer: list[dict[str, Any]] = []
        self.since = time.monotonic()

    def add(self, sample: dict[str, Any]) -> None:
        self.buffer.append(sample)
        due = time.monotonic() - self.since >= self.max_seconds
        if len(self.buffer) >= self.max_samples or due:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.before_write(self.buffer)
            judged_at = round(time.time(), 6)  # lets a Redis wipe rebuild the window in order
            written = written_stamp(self.worker, judged_at, time.monotonic() - self.since)
            for sample in self.buffer:
                sample["quality"]["judged_at"] = judged_at
                sample["written"] = written
            accepted = [s for s in self.buffer if s["quality"]["passed"]]
            rejected = [s for s in self.buffer if not s["quality"]["passed"]]
            for samples, is_rejected in ((accepted, False), (rejected, True)):
                if samples:
                    key = self.parts.write(samples, rejected=is_rejected)
                    log.info("run %s shard %d: wrote %s (%d samples)", self.parts.task.run,
                             self.parts.task.shard, key.split("/", 2)[-1], len(samples))
            self.on_write(accepted, rejected)
        self.buffer = []
        self.since = time.monotonic()
