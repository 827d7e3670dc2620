"""The live quality gate of a generate worker: count each written part, pause the run if needed.

Every generate worker reports each part it writes here (Redis, shared by all workers). When the
rejection rate over the last ``pause_after`` samples exceeds ``max_reject_rate`` (or, before
that many samples, once so many are rejected that the rate at ``pause_after`` must exceed it)
the run is **paused**: workers start no new shard and stop in-flight shards at their next part.
The state's format, its rebuild and ``resume`` live in :mod:`common.monitor.run_monitor` (the
CLI reads it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import cast

from common import keys
from common.choices import GateEvent
from common.errors import RunPaused
from common.gates.judge import mark_duplicate
from common.monitor.run_monitor import (
    EXAMPLES,
    GateState,
    Samples,
    Thresholds,
    count_samples,
    examples_of,
    stamp,
)
from common.queue import redis_keys
from common.queue.redis_values import count_of
from common.runs.records import dumps
from common.runs.schemas import GateExample, PauseRecord, PauseWindow

log = logging.getLogger(__name__)


def pause_reason(window: list[int], since: int, max_rate: float, size: int) -> str | None:
    """Why the run must pause, given the newest-first outcomes (1 = rejected), else None."""
    recent = window[:size]
    rejected = sum(recent)
    if since >= size and recent and rejected / len(recent) > max_rate:
        return (f"rejection rate {rejected / len(recent):.0%} over the last {len(recent)} "
                f"samples exceeds the {max_rate:.0%} threshold")
    if since < size and rejected > max_rate * size:
        return (f"{rejected} of the first {since} samples rejected: the rate over {size} "
                f"samples would exceed the {max_rate:.0%} threshold")
    return None


def window_stats(outcomes: list[int], limits: Thresholds) -> PauseWindow:
    """The rolling window that a pause decision looked at (newest-first outcomes)."""
    recent = outcomes[:limits.pause_after]
    return {"size": len(recent), "rejected": sum(recent), "limit": limits.pause_after,
            "rate": round(sum(recent) / len(recent), 4) if recent else 0.0,
            "max_reject_rate": limits.max_reject_rate}


class RunMonitor(GateState):
    """One run's shared quality state, as the generate stage updates it; cheap per shard."""

    def check(self) -> None:
        """Raise :class:`RunPaused` while the run is paused."""
        pause = self.paused()
        if pause:
            raise RunPaused(f"run {self.run} is paused: {pause['reason']}")

    def claim_answers(self, samples: Samples) -> None:
        """The run-wide duplicate gate: the first sample to give an answer owns it."""
        if not self.gates.reject_duplicates:
            return
        candidates = [s for s in samples if s["quality"]["passed"]]
        if not candidates:
            return
        answers = redis_keys.RunKeys(self.run).answers
        pipe = self.client.pipeline(transaction=False)
        for sample in candidates:
            pipe.hsetnx(answers, sample["quality"]["answer_hash"], sample["id"])
        lost = [s for s, won in zip(candidates, pipe.execute(), strict=True) if not won]
        if not lost:
            return
        # The client decodes responses: owners are sample ids (text) or None.
        owners = cast(list[str | None],
                      self.client.hmget(answers, [s["quality"]["answer_hash"] for s in lost]))
        for sample, owner in zip(lost, owners, strict=True):
            if owner is not None and owner != sample["id"]:
                mark_duplicate(sample["quality"], owner)

    def record(self, accepted: Samples, rejected: Samples) -> PauseRecord | None:
        """Count a written part; pause the run if needed; returns the pause in force, if any."""
        samples = accepted + rejected
        if not samples:
            return self.paused()
        limits = self.thresholds()
        pipe = self.client.pipeline(transaction=False)
        count_samples(pipe, self.run, samples, limits.pause_after)
        pipe.lrange(redis_keys.RunKeys(self.run).gate_window, 0, -1)
        pipe.hget(redis_keys.RunKeys(self.run).gates, "since")
        redis_keys.read_pause(pipe, self.run)
        *_, window, since, events, newest, lifted = pipe.execute()
        paused = redis_keys.pause_in(self.run, int(events), newest, lifted)
        if paused:
            return paused
        gates = redis_keys.RunKeys(self.run).gates
        outcomes = [0 if x in ("0", b"0") else 1 for x in window]   # else: a rejection
        reason = pause_reason(outcomes, count_of(f"{gates}:since", since, 0),
                              limits.max_reject_rate, limits.pause_after)
        return self.pause(reason, window_stats(outcomes, limits)) if reason else None

    def pause(self, reason: str, window: PauseWindow | None = None) -> PauseRecord:
        """Pause the run (first caller wins) and record why, with examples, in storage."""
        gates = redis_keys.RunKeys(self.run).gates
        stats = cast(dict[str, str], self.client.hgetall(gates))
        reasons = {k.split(":", 1)[1]: count_of(f"{gates}:{k}", v, 0) for k, v in stats.items()
                   if k.startswith("reason:")}
        top = ", ".join(f"{r} {n}" for r, n in Counter(reasons).most_common(3))
        examples: list[GateExample] = []
        for name, _ in Counter(reasons).most_common():
            key = redis_keys.RunKeys(self.run).gate_examples(name)
            examples += [x for x in examples_of(key, self.client.lrange(key, 0, EXAMPLES - 1))
                         if x["id"] not in {e["id"] for e in examples}]
        record: PauseRecord = {
            "reason": f"{reason} (top reasons: {top})" if top else reason,
            "examples": examples[:EXAMPLES], "at": time.time(),
            "checked": count_of(f"{gates}:checked", stats.get("checked"), 0),
            "rejected": count_of(f"{gates}:rejected", stats.get("rejected"), 0),
            "reasons": reasons,
            "window": window}
        if redis_keys.push_pause(self.client, self.run, record):
            log.error("run %s: PAUSED by the quality gates: %s", self.run, record["reason"])
            self.storage.put_once(keys.gate_event(self.run, GateEvent.PAUSE, stamp()),
                                  dumps(record))
            return record
        return self.paused() or record
