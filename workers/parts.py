"""A shard's generated parts: what is already written, writing new ones, and the commit.

Parts are put-once objects; a shard can hold parts from several attempts (a worker killed
mid-shard, a redelivery). The commit lists exactly one canonical copy of every input sample:
parts are read in order and the first part holding an id wins.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.errors import StorageError
from common.records import ShardCommit, ShardTask, decode_jsonl_zst, dumps, encode_jsonl_zst
from common.storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampleStat:
    """What the commit needs of a sample, so parts are read at most once per attempt."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str

    @classmethod
    def of(cls, sample: dict[str, Any]) -> SampleStat:
        usage = sample.get("usage", {})
        return cls(sample["id"], usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                   sample.get("finish_reason", "stop"))


@dataclass
class ShardParts:
    storage: Storage
    task: ShardTask
    known: dict[str, list[SampleStat]] = field(default_factory=dict)

    def refresh(self) -> None:
        """Read every part written so far that this object has not seen yet."""
        prefix = keys.generated_shard_prefix(self.task.run, self.task.shard)
        for key in self.storage.list(prefix):
            if keys.part_number(key) is not None and key not in self.known:
                samples = decode_jsonl_zst(self.storage.get(key))
                self.known[key] = [SampleStat.of(s) for s in samples]

    @property
    def done_ids(self) -> set[str]:
        return {stat.id for stats in self.known.values() for stat in stats}

    @property
    def next_part(self) -> int:
        numbers = [keys.part_number(k) for k in self.known]
        return max((n for n in numbers if n is not None), default=-1) + 1

    def write(self, samples: list[dict[str, Any]]) -> str:
        """Write ``samples`` as the next free part number; returns its key."""
        data = encode_jsonl_zst(samples)
        number = self.next_part
        while True:
            key = keys.generated_part(self.task.run, self.task.shard, number)
            if self.storage.put_once(key, data):
                self.known[key] = [SampleStat.of(s) for s in samples]
                return key
            # Another attempt wrote this number meanwhile; the commit dedups, so just move on.
            log.warning("run %s shard %d: part %d exists, trying next", self.task.run,
                        self.task.shard, number)
            number += 1

    def commit(self, expected: list[str], worker: str) -> ShardCommit:
        """Write ``_COMMIT.json`` over the canonical samples; an existing commit wins."""
        self.refresh()
        part_of: dict[str, str] = {}
        chosen: list[SampleStat] = []
        wanted = set(expected)
        for key in sorted(self.known):
            for stat in self.known[key]:
                if stat.id in wanted and stat.id not in part_of:
                    part_of[stat.id] = key
                    chosen.append(stat)
        missing = [i for i in expected if i not in part_of]
        if missing:
            raise StorageError(f"shard {self.task.shard}: {len(missing)} samples missing "
                               f"from parts, e.g. {missing[:3]}")
        commit = ShardCommit(
            run=self.task.run, shard=self.task.shard,
            parts=sorted(set(part_of.values())), sample_ids=list(expected), part_of=part_of,
            stats=_stats(chosen), worker=worker,
        )
        key = keys.generated_commit(self.task.run, self.task.shard)
        if not self.storage.put_once(key, dumps(commit.to_json())):
            log.info("run %s shard %d: already committed by another worker", self.task.run,
                     self.task.shard)
            return ShardCommit.from_json(json.loads(self.storage.get(key)))
        return commit


def _stats(chosen: list[SampleStat]) -> dict[str, Any]:
    return {
        "samples": len(chosen),
        "prompt_tokens": sum(s.prompt_tokens for s in chosen),
        "completion_tokens": sum(s.completion_tokens for s in chosen),
        "finish_reasons": dict(Counter(s.finish_reason for s in chosen)),
    }


class PartBuffer:
    """Collects finished samples and writes a part every N samples or T seconds."""

    def __init__(self, parts: ShardParts, max_samples: int, max_seconds: float,
                 on_write: Callable[[list[dict[str, Any]]], None]) -> None:
        self.parts, self.max_samples, self.max_seconds = parts, max_samples, max_seconds
        self.on_write = on_write
        self.buffer: list[dict[str, Any]] = []
        self.since = time.monotonic()

    def add(self, sample: dict[str, Any]) -> None:
        self.buffer.append(sample)
        due = time.monotonic() - self.since >= self.max_seconds
        if len(self.buffer) >= self.max_samples or due:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            key = self.parts.write(self.buffer)
            log.info("run %s shard %d: wrote %s (%d samples)", self.parts.task.run,
                     self.parts.task.shard, key.rsplit("/", 1)[-1], len(self.buffer))
            self.on_write(self.buffer)
        self.buffer = []
        self.since = time.monotonic()
