"""The Redis side of ``status``: leases, live rates, the monitor's counters (advisory; the
commits in storage are the truth), read in one pipeline, typed as they are read."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import redis

from common.choices import Stage
from common.engine.speculative import MtpChoice, SpeculativeFigures, by_worker, choices_by_worker
from common.queue import redis_keys
from common.queue.celery_app import STAGES, TRAIN
from common.queue.reconcile import read_stage, waiting_messages
from common.queue.redis_values import count_of, shard_counts
from common.queue.shard_registry import StageView
from common.runs.schemas import EngineRecord, PauseRecord
from producer.status_record import ParkedShard
from producer.status_rules import _rates


@dataclass(frozen=True)
class LiveFigures:
    """One reading of a run's Redis records (``status`` reads None when Redis is down)."""

    stages: dict[str, StageView]
    parked: list[ParkedShard]
    partial: dict[int, int]          # samples in progress by shard
    tokens_per_s: float
    samples_per_s: float
    engines: dict[str, EngineRecord]
    gates: dict[str, str]            # the run monitor's counters, as Redis holds them (text)
    window: list[int]                # the gate window's outcomes (1: rejected)
    pause: PauseRecord | None
    train: dict[str, str]            # the trainer's metrics record (text)
    speculative: dict[str, SpeculativeFigures]
    mtp: dict[str, MtpChoice]

    @property
    def owned_anywhere(self) -> bool:
        """Whether any stage of the run has a live lease or a queued message behind a marker."""
        return any(view.owned for view in self.stages.values())


def read_live(client: redis.Redis, run: str, lease_ttl: float,
              committed: Container[int]) -> LiveFigures | None:
    """Redis-side figures of ``run``; None when Redis is unreachable. Parked generate shards
    already ``committed`` are left out (a commit outranks a stale parking)."""
    keys = redis_keys.RunKeys(run)
    try:
        waiting = waiting_messages(client)
        stages = {spec.name: read_stage(client, spec, run, lease_ttl, waiting)
                  for spec in STAGES}
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.partial)
        pipe.lrange(keys.rate, 0, -1)
        pipe.hgetall(redis_keys.redis_engines())
        pipe.hgetall(keys.gates)
        pipe.lrange(keys.gate_window, 0, -1)
        pipe.hgetall(TRAIN.keys(run).metrics)
        pipe.hgetall(keys.speculative)
        pipe.hgetall(keys.mtp)
        redis_keys.read_pause(pipe, run)
        (partial, events, engines, gates, window, train, spec, mtp, *pause) = pipe.execute()
    except redis.RedisError:
        return None
    tokens_per_s, samples_per_s = _rates(events)
    return LiveFigures(
        stages=stages,
        parked=[ParkedShard(stage=stage, shard=s, reason=r)
                for stage, info in stages.items() for s, r in sorted(info.parked.items())
                if stage != Stage.GENERATE or s not in committed],
        partial=shard_counts(keys.partial, partial),
        tokens_per_s=tokens_per_s,
        samples_per_s=samples_per_s,
        engines=redis_keys.engines_of(engines),
        gates=gates,
        window=[count_of(keys.gate_window, x) for x in window],
        pause=redis_keys.pause_in(run, *pause),
        train=train,
        speculative=by_worker(spec, keys.speculative),
        mtp=choices_by_worker(mtp),
    )
