"""One stage's shard registries for one run and every operation on them (rq's shape: the
registry owns its keys and what is done to them), plus the set of runs the reconciler watches.

Callers never send a hash command to these keys themselves: each step of a shard's life is one
method here (:meth:`ShardRegistry.hand_over`, :meth:`~ShardRegistry.begin`,
:meth:`~ShardRegistry.start`, :meth:`~ShardRegistry.settle`, :meth:`~ShardRegistry.park`, ...),
and a step that must be atomic is one transaction (or script) inside its method.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.typing import EncodableT, FieldT

from common.keys import parse_shard_name, shard_name
from common.queue.markers import QUEUED, RETRY, STARTED, Marker, marker
from common.queue.redis_keys import StageKeys, lease_is_live, lease_shard, redis_runs

Waiting = dict[str, set[tuple[str, int]] | None]
"""Per queue: the (run, shard) of its waiting messages, None where the queue is too long."""

# Clear a shard's ``running`` entry only if this owner still holds it; optionally mark it as
# waiting for redelivery (the handler then sets the real retry time, or parks it).
_SETTLE = """
if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('hdel', KEYS[1], ARGV[1])
  if ARGV[3] ~= '' then redis.call('hset', KEYS[2], ARGV[1], ARGV[3]) end
  return 1
end
return 0
"""


def watch_run(client: Any, run: str) -> None:
    """Add ``run`` to the runs the reconciler heals (``client``: a client or a pipeline)."""
    client.sadd(redis_runs(), run)


def watched_runs(client: redis.Redis) -> set[str]:
    # The client decodes responses (decode_responses=True): members are text.
    return cast(set[str], client.smembers(redis_runs()))


def unwatch_run(client: redis.Redis, run: str) -> None:
    """Every stage of ``run`` is done: nothing left to watch."""
    client.srem(redis_runs(), run)


@dataclass(frozen=True)
class StageView:
    """What Redis says of one stage of one run, read the same way by the reconciler and status."""

    live: frozenset[int]
    queued: frozenset[int]
    retrying: frozenset[int]
    stale: frozenset[int]
    running: dict[int, str]
    parked: dict[int, str]

    @property
    def owned(self) -> frozenset[int]:
        return self.live | self.queued

    @property
    def healing(self) -> frozenset[int]:
        """Started by a worker that holds no live lease any more (killed): due to be queued."""
        return frozenset(self.running) - self.owned


@dataclass(frozen=True)
class ShardRegistry:
    """The ``queued``, ``running``, ``attempts`` and ``parked`` hashes of one stage of one run
    (:class:`~common.queue.redis_keys.StageKeys`) and its metrics hash."""

    client: redis.Redis
    keys: StageKeys

    # -- queueing ------------------------------------------------------------------------------
    def hand_over(self, shard: int, *, fresh: bool = False) -> None:
        """Mark ``shard`` queued (its message is sent next) and the run watched; ``fresh``
        forgets a parking and its delivery count: re-queuing a parked shard is the user's
        decision to try again."""
        field = shard_name(shard)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.queued, field, marker(QUEUED, time.time()))
        watch_run(pipe, self.keys.run)
        if fresh:
            pipe.hdel(self.keys.parked, field)
            pipe.hdel(self.keys.attempts, field)
        pipe.execute()

    def is_queued(self, shard: int) -> bool:
        return bool(self.client.hexists(self.keys.queued, shard_name(shard)))

    def is_parked(self, shard: int) -> bool:
        return bool(self.client.hexists(self.keys.parked, shard_name(shard)))

    def mark_retry(self, shard: int, due: float) -> None:
        """The shard's countdown retry is due at ``due`` (a worker holds its message)."""
        self.client.hset(self.keys.queued, shard_name(shard), marker(RETRY, due))

    def unqueue(self, shard: int) -> None:
        """Forget the queued marker (the shard is done, paused or parked; resume re-queues)."""
        self.client.hdel(self.keys.queued, shard_name(shard))

    def forget_lost(self, shard: int) -> None:
        """Before the reconciler re-sends a shard: the worker that takes it shows it again."""
        self.client.hdel(self.keys.running, shard_name(shard))

    # -- one delivery --------------------------------------------------------------------------
    def begin(self, shard: int) -> int:
        """Count a delivery before anything is read, mark it starting; the deliveries so far."""
        field = shard_name(shard)
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.keys.attempts, field)
        pipe.hset(self.keys.queued, field, marker(STARTED, time.time()))
        watch_run(pipe, self.keys.run)
        return int(pipe.execute()[0])

    def start(self, shard: int, owner: str) -> None:
        """The lease is taken: show the shard running under ``owner``, no longer queued."""
        field = shard_name(shard)
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.queued, field)
        pipe.hset(self.keys.running, field, owner)
        pipe.execute()

    def settle(self, shard: int, owner: str, mark: str = "") -> bool:
        """Clear the running entry if ``owner`` still holds it, and set ``mark`` (a marker, or
        "" for none) as its queued value, in one step; whether ``owner`` held it."""
        return bool(self.client.eval(_SETTLE, 2, self.keys.running, self.keys.queued,
                                     shard_name(shard), owner, mark))

    def attempts(self, shard: int) -> int:
        return int(self.client.hget(self.keys.attempts, shard_name(shard)) or 0)

    def forget_attempts(self, shard: int) -> None:
        self.client.hdel(self.keys.attempts, shard_name(shard))

    def give_back_attempt(self, shard: int) -> None:
        """A stop or pause is not the shard's fault: it does not count toward the cap."""
        self.client.hincrby(self.keys.attempts, shard_name(shard), -1)

    def park(self, shard: int, reason: str) -> None:
        """Stop redelivering the shard (status shows ``reason``), in one transaction."""
        field = shard_name(shard)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.parked, field, reason)
        pipe.hdel(self.keys.queued, field)
        pipe.execute()

    # -- the stage's metrics -------------------------------------------------------------------
    def record_metrics(self, record: Mapping[str, Any]) -> None:
        self.client.hset(self.keys.metrics, mapping=cast(dict[FieldT, EncodableT], record))

    def metrics(self) -> dict[str, str]:
        # The client decodes responses: field names and values are text.
        return cast(dict[str, str], self.client.hgetall(self.keys.metrics))

    # -- reading -------------------------------------------------------------------------------
    def view(self, lease_ttl: float, in_queue: set[tuple[str, int]] | None,
             one_per_run: bool = False, now: float | None = None) -> StageView:
        """The stage's shards: leased (live), queued (a message or a starting delivery), parked.

        ``in_queue``: the (run, shard) of the stage queue's waiting messages (None: not read).
        """
        now = time.time() if now is None else now
        names, run = self.keys, self.keys.run
        leases = list(self.client.scan_iter(names.lease_pattern, count=1000))
        pipe = self.client.pipeline(transaction=False)
        for key in leases:
            pipe.get(key)
            pipe.pttl(key)
        pipe.hgetall(names.running)
        pipe.hgetall(names.queued)
        pipe.hgetall(names.parked)
        *lease_info, running, queued, parked = pipe.execute()
        live = set()
        for key, token, pttl in zip(leases, lease_info[::2], lease_info[1::2], strict=True):
            shard = lease_shard(token)
            if shard is None and not one_per_run:
                shard = parse_shard_name(key.rpartition(":")[2])
            if shard is not None and lease_is_live(token, pttl):
                live.add(shard)
        held, retrying, stale = set(), set(), set()
        for name, value in queued.items():
            shard, mark = parse_shard_name(name), Marker.parse(value)
            seen = None if in_queue is None else (run, shard) in in_queue
            if mark is not None and mark.holds(now, lease_ttl, seen, one_per_run and bool(live)):
                held.add(shard)
                if mark.kind == RETRY:
                    retrying.add(shard)
            else:
                stale.add(shard)
        return StageView(frozenset(live), frozenset(held), frozenset(retrying),
                         frozenset(stale), {parse_shard_name(k): v for k, v in running.items()},
                         {parse_shard_name(k): v for k, v in parked.items()})
