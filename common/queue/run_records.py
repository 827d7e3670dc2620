"""A run's advisory Redis records that generate workers write and ``status`` reads: progress,
request counts, speculative figures, MTP choices, and the announced engine servers.

Each record has one writer operation here, so no worker edits these hashes itself (the keys:
:class:`common.queue.redis_keys.RunKeys`). Callers handle ``redis.RedisError``: every record
is advisory, rebuilt or outdated harmlessly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from common.engine.speculative import ALGORITHM, STEPS, TOKENS, field
from common.keys import shard_name
from common.queue.redis_keys import RunKeys, redis_engines

RATE_ENTRIES = 1000
"""Entries of the rate list kept (tokens/s and ETA read the recent ones)."""


def publish_engine(client: redis.Redis, host_gpu: str, record: dict[str, Any]) -> None:
    """Tell ``status`` where an engine server runs (``host:gpuN`` -> its record)."""
    client.hset(redis_engines(), host_gpu, json.dumps(record))


@dataclass(frozen=True)
class RunRecords:
    """One run's worker-written records."""

    client: redis.Redis
    run: str

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run)

    def record_part(self, shard: int, samples: int, tokens: int) -> None:
        """A part written: its samples count toward the shard's partial total, and the rate
        list gains one ``timestamp tokens samples`` entry (one transaction)."""
        pipe = self.client.pipeline()
        pipe.hincrby(self.keys.partial, shard_name(shard), samples)
        pipe.lpush(self.keys.rate, f"{time.time():.3f} {tokens} {samples}")
        pipe.ltrim(self.keys.rate, 0, RATE_ENTRIES - 1)
        pipe.execute()

    def forget_partial(self, shard: int) -> None:
        """The shard is committed (or started afresh): its parts are no longer partial."""
        self.client.hdel(self.keys.partial, shard_name(shard))

    def count_requests(self, worker: str, sent: int) -> None:
        self.client.hincrby(self.keys.requests, worker, sent)

    def add_speculative(self, worker: str, steps: int, tokens: int,
                        algorithm: str | None) -> None:
        """Add a worker's verify steps and accepted tokens (and name its algorithm)."""
        pipe = self.client.pipeline()
        pipe.hincrby(self.keys.speculative, field(STEPS, worker), steps)
        pipe.hincrby(self.keys.speculative, field(TOKENS, worker), tokens)
        if algorithm:
            pipe.hset(self.keys.speculative, field(ALGORITHM, worker), algorithm)
        pipe.execute()

    def record_mtp(self, worker: str, choice: dict[str, Any]) -> None:
        """The run's MTP choice on ``worker`` as ``status`` shows it."""
        self.client.hset(self.keys.mtp, worker, json.dumps(choice))
