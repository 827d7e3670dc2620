"""The rules ``status`` reads a run by, apart from the reading: a run's state, a shard's, the
rates and ETA, and the line of an epoch's hours (the trainer's progress:
:mod:`producer.status_training`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.choices import RunState, ShardState
from common.queue.shard_registry import StageView
from producer.status_record import TrainFigures

RATE_WINDOW_S = 120.0

@dataclass(frozen=True)
class StoredProgress:
    samples: int
    rejected: int


def _eta(state: RunState, remaining: int | None, rate: float | None) -> float | None:
    """Seconds left at the recent rate; none while paused or when the rate is unknown."""
    if remaining == 0:
        return 0.0
    if state is RunState.PAUSED or not rate or remaining is None:
        return None
    return round(remaining / rate, 1)


def _rates(events: list[str]) -> tuple[float, float]:
    """Tokens/s and samples/s over the recent window of part writes."""
    now = time.time()
    recent = [tuple(map(float, e.split())) for e in events]
    recent = [e for e in recent if now - e[0] <= RATE_WINDOW_S]
    if not recent:
        return 0.0, 0.0
    span = max(now - min(e[0] for e in recent), 1.0)
    return sum(e[1] for e in recent) / span, sum(e[2] for e in recent) / span


GRID_STATES = (ShardState.RUNNING, ShardState.HEALING, ShardState.RETRYING, ShardState.PENDING,
               ShardState.PARKED)
"""The states ``status`` counts beside committed (None for each while Redis is down)."""


def shard_state(shard: int, committed: set[int], view: StageView | None) -> ShardState:
    """One generate shard's state, as the grid shows it and ``status`` counts it."""
    if shard in committed:
        return ShardState.COMMITTED
    if view is None:
        return ShardState.UNKNOWN
    if shard in view.parked:
        return ShardState.PARKED
    if shard in view.live:
        return ShardState.RUNNING
    if shard in view.healing:
        return ShardState.HEALING
    if shard in view.retrying:
        return ShardState.RETRYING
    return ShardState.PENDING


def _state(enqueued: bool, total: int, committed: int, parked: int, running: int,
           progressed: int, owned: bool | None) -> RunState:
    """``stalled``: work left, yet no live lease and no queued message (no worker will move it
    until one starts, or the reconciler of a live one queues it again)."""
    if not enqueued:
        return RunState.ENQUEUING
    if committed == total:
        return RunState.DONE
    if committed + parked == total:
        return RunState.FAILED
    if owned is False:
        return RunState.STALLED
    if running or progressed:
        return RunState.RUNNING
    return RunState.PENDING


def epoch_hours_line(train: TrainFigures) -> str | None:
    """The text status's line of an epoch's hours, planned beside measured (None: not yet)."""
    measured, planned = train.get("epoch_hours_measured"), train.get("epoch_hours_planned")
    if measured is None:
        return None
    plan = "no plan on the CPU"
    if planned is not None:
        plan = f"the plan {planned:.3g} h" + (
            f", measured/plan {measured / planned:.2f}" if planned > 0 else "")
    return f"  epoch   {measured:.3g} h at the measured steps' pace ({plan})"
