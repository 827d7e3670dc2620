"""The run monitor: rolling rejection rate, supervised-token histogram, duplicates and the pause.

Every generate worker reports each part it writes here (Redis, shared by all workers). When the
rejection rate over the last ``pause_after`` samples exceeds ``max_reject_rate`` (or, before
that many samples, once so many are rejected that the rate at ``pause_after`` must exceed it)
the run is **paused**: workers start no new shard and stop in-flight shards at their next part.
``dflash-pipeline resume --run RUN --accept-gates`` (or new thresholds) continues. Pause and
resume decisions are also written to storage (``runs/<run>/gates/``), so that when Redis lost
the monitor's state one worker rebuilds it from the commits' summaries (and the parts of
uncommitted shards: :mod:`common.monitor_rebuild`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from common import keys
from common.errors import RunPaused
from common.gates import GateConfig, mark_duplicate
from common.partstats import example
from common.records import dumps
from common.storage import Storage

log = logging.getLogger(__name__)

EXAMPLES = 3
REBUILD_WAIT_S = 600.0
Samples = list[dict[str, Any]]


def stamp() -> str:
    """A key suffix that sorts chronologically (to the microsecond) and never collides."""
    now = time.time()
    return (time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}"
            f"-{uuid.uuid4().hex[:6]}")


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


def window_stats(outcomes: list[int], limits: Thresholds) -> dict[str, Any]:
    """The rolling window that a pause decision looked at (newest-first outcomes)."""
    recent = outcomes[:limits.pause_after]
    return {"size": len(recent), "rejected": sum(recent), "limit": limits.pause_after,
            "rate": round(sum(recent) / len(recent), 4) if recent else 0.0,
            "max_reject_rate": limits.max_reject_rate}


@dataclass(frozen=True)
class Thresholds:
    """The pause thresholds in force: run.json's, or the latest set by ``resume``."""

    max_reject_rate: float
    pause_after: int


class RunMonitor:
    """One run's shared quality state; cheap to create per shard."""

    def __init__(self, client: redis.Redis, storage: Storage, run: str, gates: GateConfig) -> None:
        self.client, self.storage, self.run, self.gates = client, storage, run, gates

    def thresholds(self) -> Thresholds:
        rate, after = self.client.hmget(keys.redis_gates(self.run), "max_reject_rate",
                                        "pause_after")
        return Thresholds(float(rate) if rate is not None else self.gates.max_reject_rate,
                          int(after) if after is not None else self.gates.pause_after)

    def paused(self) -> dict[str, Any] | None:
        raw = self.client.get(keys.redis_paused(self.run))
        return json.loads(raw) if raw else None

    def check(self) -> None:
        """Raise :class:`RunPaused` while the run is paused."""
        pause = self.paused()
        if pause:
            raise RunPaused(f"run {self.run} is paused: {pause['reason']}")

    def ensure_ready(self) -> None:
        """Rebuild the shared state from storage if Redis lost it (one worker does it)."""
        if self.client.hexists(keys.redis_gates(self.run), "ready"):
            return
        lock = keys.redis_gate_rebuild(self.run)
        if self.client.set(lock, "1", nx=True, ex=int(REBUILD_WAIT_S)):
            try:  # the lock is renewed as the rebuild goes, so no second worker starts one
                rebuild(self.client, self.storage, self.run, self.gates,
                        lambda: self.client.expire(lock, int(REBUILD_WAIT_S)))
            finally:
                self.client.delete(lock)
            return
        while not self.client.hexists(keys.redis_gates(self.run), "ready"):
            if not self.client.exists(lock):  # the rebuilder died (its lock expired): take over
                return self.ensure_ready()
            time.sleep(0.2)

    def claim_answers(self, samples: Samples) -> None:
        """The run-wide duplicate gate: the first sample to give an answer owns it."""
        if not self.gates.reject_duplicates:
            return
        candidates = [s for s in samples if s["quality"]["passed"]]
        if not candidates:
            return
        answers = keys.redis_answers(self.run)
        pipe = self.client.pipeline(transaction=False)
        for sample in candidates:
            pipe.hsetnx(answers, sample["quality"]["answer_hash"], sample["id"])
        lost = [s for s, won in zip(candidates, pipe.execute(), strict=True) if not won]
        if not lost:
            return
        owners = self.client.hmget(answers, [s["quality"]["answer_hash"] for s in lost])
        for sample, owner in zip(lost, owners, strict=True):
            if owner is not None and owner != sample["id"]:
                mark_duplicate(sample["quality"], owner)

    def record(self, accepted: Samples, rejected: Samples) -> dict[str, Any] | None:
        """Count a written part; pause the run if needed; returns the pause in force, if any."""
        samples = accepted + rejected
        if not samples:
            return self.paused()
        limits = self.thresholds()
        pipe = self.client.pipeline(transaction=False)
        count_samples(pipe, self.run, samples, limits.pause_after)
        pipe.lrange(keys.redis_gate_window(self.run), 0, -1)
        pipe.hget(keys.redis_gates(self.run), "since")
        pipe.get(keys.redis_paused(self.run))
        *_, window, since, paused = pipe.execute()
        if paused:
            return json.loads(paused)
        outcomes = [int(x) for x in window]
        reason = pause_reason(outcomes, int(since or 0), limits.max_reject_rate,
                              limits.pause_after)
        return self.pause(reason, window_stats(outcomes, limits)) if reason else None

    def pause(self, reason: str, window: dict[str, Any] | None = None) -> dict[str, Any]:
        """Pause the run (first caller wins) and record why, with examples, in storage."""
        stats = self.client.hgetall(keys.redis_gates(self.run))
        reasons = {k.split(":", 1)[1]: int(v) for k, v in stats.items() if k.startswith("reason:")}
        top = ", ".join(f"{r} {n}" for r, n in Counter(reasons).most_common(3))
        examples = []
        for name, _ in Counter(reasons).most_common():
            raw = self.client.lrange(keys.redis_gate_examples(self.run, name), 0, EXAMPLES - 1)
            examples += [json.loads(x) for x in raw if json.loads(x)["id"] not in
                         {e["id"] for e in examples}]
        record = {"reason": f"{reason} (top reasons: {top})" if top else reason,
                  "examples": examples[:EXAMPLES], "at": time.time(),
                  "checked": int(stats.get("checked", 0)),
                  "rejected": int(stats.get("rejected", 0)), "reasons": reasons,
                  "window": window}
        if self.client.set(keys.redis_paused(self.run), json.dumps(record), nx=True):
            log.error("run %s: PAUSED by the quality gates: %s", self.run, record["reason"])
            self.storage.put_once(keys.gate_event(self.run, "pause", stamp()), dumps(record))
            return record
        return self.paused() or record


def count_samples(pipe: Any, run: str, samples: Samples, window: int) -> None:
    """Queue the counter updates of ``samples`` on a Redis pipeline."""
    if not samples:
        return
    gates, hist = keys.redis_gates(run), keys.redis_gate_hist(run)
    rejected = [s for s in samples if not s["quality"]["passed"]]
    pipe.hincrby(gates, "checked", len(samples))
    pipe.hincrby(gates, "since", len(samples))
    pipe.hincrby(gates, "rejected", len(rejected))
    for reason, count in Counter(r for s in rejected for r in s["quality"]["reasons"]).items():
        pipe.hincrby(gates, f"reason:{reason}", count)
    for tokens, count in Counter(t for s in samples
                                 for t in s["quality"]["supervised_tokens"]).items():
        pipe.hincrby(hist, str(tokens), count)
    pipe.lpush(keys.redis_gate_window(run), *("0" if s["quality"]["passed"] else "1"
                                              for s in samples))
    pipe.ltrim(keys.redis_gate_window(run), 0, window - 1)
    for sample in rejected:
        for reason in sample["quality"]["reasons"]:
            name = keys.redis_gate_examples(run, reason)
            pipe.lpush(name, json.dumps(example(sample)))
            pipe.ltrim(name, 0, EXAMPLES - 1)


def gate_events(storage: Storage, run: str) -> list[tuple[str, dict[str, Any]]]:
    """Pause and resume records in chronological order, as (kind, record)."""
    events = []
    names = {key: key.rsplit("/", 1)[-1].split("-", 1) for key in
             storage.list(keys.gates_prefix(run))}
    for key in sorted(names, key=lambda k: names[k][-1]):
        if names[key][0] in ("pause", "resume"):
            events.append((names[key][0], json.loads(storage.get(key))))
    return events


def pause_from_storage(storage: Storage, run: str) -> dict[str, Any] | None:
    """The pause in force according to storage: the latest event, if it is a pause."""
    events = gate_events(storage, run)
    return events[-1][1] if events and events[-1][0] == "pause" else None


def rebuild(client: redis.Redis, storage: Storage, run: str, gates: GateConfig,
            heartbeat: Callable[[], None] = lambda: None) -> None:
    """Recompute the monitor's Redis state from commit summaries and uncommitted parts."""
    from common.monitor_rebuild import rebuild_from_summaries

    events, last, size, accepted_at = resume_state(storage, run, gates)
    rebuild_from_summaries(client, storage, run, size=size, accepted_at=accepted_at,
                           last_resume=last, heartbeat=heartbeat,
                           pause=events[-1][1] if events and events[-1][0] == "pause" else None)


def resume_state(storage: Storage, run: str, gates: GateConfig) -> tuple[
        list[tuple[str, dict[str, Any]]], dict[str, Any], int, int]:
    """Gate events, the last resume, the window size and the count at the last acceptance."""
    events = gate_events(storage, run)
    resumes = [record for kind, record in events if kind == "resume"]
    last = resumes[-1] if resumes else {}
    size = int(last.get("pause_after") or gates.pause_after)
    accepted_at = max((int(r.get("checked", 0)) for r in resumes if r.get("accepted")), default=0)
    return events, last, size, accepted_at


def resume_gates(client: redis.Redis, storage: Storage, run: str, gates: GateConfig, *,
                 accept: bool, max_reject_rate: float | None = None,
                 pause_after: int | None = None) -> dict[str, Any] | None:
    """Lift a pause (``accept``: count the rejections so far as accepted) or set new thresholds.

    Raises :class:`RunPaused` if the run is paused and neither was asked for.
    """
    monitor = RunMonitor(client, storage, run, gates)
    monitor.ensure_ready()
    pause = monitor.paused()
    changed = max_reject_rate is not None or pause_after is not None
    if pause and not accept and not changed:
        raise RunPaused(f"run {run} is paused by its quality gates: {pause['reason']}. Look at "
                        f"`dflash-pipeline report --run {run}`, then resume with --accept-gates "
                        "or new thresholds (--max-reject-rate, --pause-after)")
    if not pause and not accept and not changed:
        return None
    limits = monitor.thresholds()
    checked = int(client.hget(keys.redis_gates(run), "checked") or 0)
    record = {"accepted": accept, "at": time.time(), "checked": checked,
              "max_reject_rate": max_reject_rate if max_reject_rate is not None
              else limits.max_reject_rate,
              "pause_after": pause_after or limits.pause_after,
              "lifted": pause["reason"] if pause else None}
    storage.put_once(keys.gate_event(run, "resume", stamp()), dumps(record))
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.redis_gates(run), mapping={"max_reject_rate": record["max_reject_rate"],
                                              "pause_after": record["pause_after"]})
    if accept:
        pipe.hset(keys.redis_gates(run), "since", 0)
        pipe.delete(keys.redis_gate_window(run))
    pipe.delete(keys.redis_paused(run))
    pipe.execute()
    log.info("run %s: gates resumed (accept=%s, max_reject_rate=%s, pause_after=%s)", run, accept,
             record["max_reject_rate"], record["pause_after"])
    return record
