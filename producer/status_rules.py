"""The rules ``status`` reads a run by, apart from the reading: a run's state, a shard's, the
rates and ETA, and the trainer's progress."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from common.choices import ShardState
from common.queue.redis_values import field_key, number_of
from common.queue.shard_registry import StageView
from common.runs.records import RunState

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


def _owned_anywhere(live: dict[str, Any]) -> bool:
    """Whether any stage of the run has a live lease or a queued message behind a marker."""
    return any(view.owned for view in live["stages"].values())


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


def training_progress(train: dict[str, Any], ledger: Any, epochs: int,
                      key: str = "train metrics") -> dict[str, Any]:
    """The trainer's epoch, schedule and learning rate as numbers: the ledger (storage) for
    what it holds, the live metrics record (``key``: where it was read) for the rest
    (``status --json`` contract); a value that is no finite number is noted and absent."""
    def number(name: str, kind: type) -> Any:
        value = number_of(field_key(key, name), train.get(name))
        return kind(value) if value is not None else None

    step = number("step", int)
    return {"epoch": number("epoch", int) or min(ledger.epoch + 1, epochs), "epochs": epochs,
            "step": step, "total_steps": number("total_steps", int) or ledger.total_steps or None,
            "lr": number("lr", float), "eta_s": number("eta_s", float),
            "tau_by_epoch": list(ledger.tau_by_epoch),
            "finished": ledger.finished or None,
            # An epoch's hours: the plan's (None on the CPU) and the measured steps' pace.
            "epoch_hours_planned": number("epoch_hours_planned", float),
            "epoch_hours_measured": number("epoch_hours_measured", float)}


def epoch_hours_line(train: dict[str, Any]) -> str | None:
    """The text status's line of an epoch's hours, planned beside measured (None: not yet)."""
    measured, planned = train.get("epoch_hours_measured"), train.get("epoch_hours_planned")
    if measured is None:
        return None
    plan = "no plan on the CPU"
    if planned is not None:
        plan = f"the plan {planned:.3g} h" + (
            f", measured/plan {measured / planned:.2f}" if planned > 0 else "")
    return f"  epoch   {measured:.3g} h at the measured steps' pace ({plan})"
