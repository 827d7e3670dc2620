"""The quality gates' shared state: what the live monitor keeps in Redis and storage.

Generate workers count each part they write into Redis (:func:`count_samples`) and pause the
run when too many samples are rejected (the live gate: :mod:`workers.generate.monitor`). Pause
and resume decisions are also written to storage (``runs/<run>/gates/``), which ``status`` and
``report`` read (:func:`pause_from_storage`); ``dflash-pipeline resume --run RUN --accept-gates``
(or new thresholds) lifts a pause (:func:`resume_gates`). When Redis lost the state, one process
rebuilds it from the commits' summaries (and the parts of uncommitted shards:
:mod:`common.monitor.rebuild`). Gates fail closed and only the producer lifts a pause: a pause
record that does not read is a pause, and in Redis workers only add pause events
(:func:`redis_keys.push_pause`) while ``resume`` writes the count it lifted
(:func:`redis_keys.pause_in`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.typing import EncodableT, FieldT

from common import keys
from common.choices import GateEvent
from common.errors import ForeignObject, NotFound, RunPaused
from common.gates.judge import GateConfig
from common.gates.partstats import example, flagged, flagged_reasons, turn_counts
from common.queue import redis_keys
from common.queue.redis_values import count_of, share_of
from common.reads import note, parse_json, read_record, validated
from common.runs.records import dumps
from common.runs.schemas import GATE_EXAMPLE, PAUSE, RESUME, GateExample, PauseRecord
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


@dataclass(frozen=True)
class Thresholds:
    """The pause thresholds in force: run.json's, or the latest set by ``resume``."""

    max_reject_rate: float
    pause_after: int


class GateState:
    """One run's shared quality state (Redis, rebuilt from storage if lost); cheap to create."""

    def __init__(self, client: redis.Redis, storage: Storage, run: str, gates: GateConfig) -> None:
        self.client, self.storage, self.run, self.gates = client, storage, run, gates

    def thresholds(self) -> Thresholds:
        """The thresholds in force (a value the gates hash holds that is none: the run's)."""
        gates = redis_keys.RunKeys(self.run).gates
        rate, after = self.client.hmget(gates, "max_reject_rate", "pause_after")
        return Thresholds(share_of(f"{gates}:max_reject_rate", rate, self.gates.max_reject_rate),
                          count_of(f"{gates}:pause_after", after, self.gates.pause_after, 1))

    def pause_state(self) -> tuple[int, PauseRecord | None]:
        """The number of pause events in Redis and the pause in force (None: not paused)."""
        pipe = self.client.pipeline(transaction=False)
        redis_keys.read_pause(pipe, self.run)
        events, newest, lifted = pipe.execute()
        return int(events), redis_keys.pause_in(self.run, int(events), newest, lifted)

    def paused(self) -> PauseRecord | None:
        return self.pause_state()[1]

    def ensure_ready(self) -> None:
        """Rebuild the shared state from storage if Redis lost it (one worker does it)."""
        if self.client.hexists(redis_keys.RunKeys(self.run).gates, "ready"):
            return
        lock = redis_keys.RunKeys(self.run).gate_rebuild
        if self.client.set(lock, "1", nx=True, ex=int(REBUILD_WAIT_S)):
            try:  # the lock is renewed as the rebuild goes, so no second worker starts one
                rebuild(self.client, self.storage, self.run, self.gates,
                        lambda: bool(self.client.expire(lock, int(REBUILD_WAIT_S))))
            finally:
                self.client.delete(lock)
            return
        while not self.client.hexists(redis_keys.RunKeys(self.run).gates, "ready"):
            if not self.client.exists(lock):  # the rebuilder died (its lock expired): take over
                return self.ensure_ready()
            time.sleep(0.2)


def examples_of(key: str, raw: list[Any]) -> list[GateExample]:
    """The rejected examples a Redis list holds, each a valid example record; a value that
    is not one is noted and left out (so it cannot make the pause that quotes it foreign)."""
    found = []
    for value in raw:
        try:
            found.append(validated(key, parse_json(key, value), GATE_EXAMPLE))
        except ForeignObject as exc:
            note(exc)
    return found


def count_samples(pipe: Any, run: str, samples: Samples, window: int) -> None:
    """Queue the counter updates of ``samples`` on a Redis pipeline: conversations, turns and
    thinking modes; a conversation with a rejected turn is a 1 in the rolling window."""
    if not samples:
        return
    gates, hist = redis_keys.RunKeys(run).gates, redis_keys.RunKeys(run).gate_hist
    rejected = [s for s in samples if not s["quality"]["passed"]]
    marked = [s for s in samples if flagged(s["quality"])]
    turns = [turn_counts(s["quality"]) for s in samples]
    pipe.hincrby(gates, "checked", len(samples))
    pipe.hincrby(gates, "since", len(samples))
    pipe.hincrby(gates, "rejected", len(rejected))
    pipe.hincrby(gates, "turns", sum(t[0] for t in turns))
    pipe.hincrby(gates, "turns_rejected", sum(t[1] for t in turns))
    pipe.hincrby(gates, "thinking_off", sum(s["quality"].get("thinking") is False
                                            for s in samples))
    for reason, count in Counter(r for s in marked
                                 for r in flagged_reasons(s["quality"])).items():
        pipe.hincrby(gates, f"reason:{reason}", count)
    for tokens, count in Counter(t for s in samples
                                 for t in s["quality"]["supervised_tokens"]).items():
        pipe.hincrby(hist, str(tokens), count)
    pipe.lpush(redis_keys.RunKeys(run).gate_window, *("1" if flagged(s["quality"]) else "0"
                                                      for s in samples))
    pipe.ltrim(redis_keys.RunKeys(run).gate_window, 0, window - 1)
    for sample in marked:
        for reason in flagged_reasons(sample["quality"]):
            name = redis_keys.RunKeys(run).gate_examples(reason)
            pipe.lpush(name, json.dumps(example(sample)))
            pipe.ltrim(name, 0, EXAMPLES - 1)


def gate_events(storage: Storage, run: str) -> list[tuple[GateEvent, dict[str, Any]]]:
    """Pause and resume records as (kind, record), in the order storage wrote them (its own
    time of each write, ties by key: never a stamp a writer chose); each bounded and typed. A
    foreign resume is noted and left out; a foreign pause is noted and still a pause (a gate
    fails closed: the generate key may write pauses, only the producer's lifts them)."""
    found = [(obj.modified, obj.key, GateEvent(parsed.name)) for obj in
             storage.list_objects(keys.gates_prefix(run))
             if (parsed := keys.parse(obj.key)) is not None
             and parsed.kind is keys.KeyKind.GATE]
    events = []
    for _, key, kind in sorted(found):
        try:
            events.append((kind, read_record(storage, key,
                                                PAUSE if kind is GateEvent.PAUSE else RESUME)))
        except ForeignObject as exc:
            note(exc)
            if kind is GateEvent.PAUSE:
                events.append((kind, {"reason": f"unreadable pause record ({exc.why})"}))
        except NotFound:
            continue
    return events


def pause_from_storage(storage: Storage, run: str) -> PauseRecord | None:
    """The pause in force according to storage: the latest event, if it is a pause."""
    events = gate_events(storage, run)
    # A pause event's record was read as PAUSE (or is the reason a foreign one was set aside).
    return cast(PauseRecord, events[-1][1]) if events and events[-1][0] is GateEvent.PAUSE else None


def rebuild(client: redis.Redis, storage: Storage, run: str, gates: GateConfig,
            heartbeat: Callable[[], object] = lambda: None) -> None:
    """Recompute the monitor's Redis state from commit summaries and uncommitted parts."""
    from common.monitor.rebuild import rebuild_from_summaries

    events, last, size, accepted_at = resume_state(storage, run, gates)
    rebuild_from_summaries(client, storage, run, size=size, accepted_at=accepted_at,
                           last_resume=last, heartbeat=heartbeat,
                           pause=events[-1][1] if events and events[-1][0] is GateEvent.PAUSE
                           else None)


def resume_state(storage: Storage, run: str, gates: GateConfig) -> tuple[
        list[tuple[GateEvent, dict[str, Any]]], dict[str, Any], int, int]:
    """Gate events, the last resume, the window size and the count at the last acceptance."""
    events = gate_events(storage, run)
    resumes = [record for kind, record in events if kind is GateEvent.RESUME]
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
    monitor = GateState(client, storage, run, gates)
    monitor.ensure_ready()
    events, pause = monitor.pause_state()   # a pause added after this read stays in force
    changed = max_reject_rate is not None or pause_after is not None
    if pause and not accept and not changed:
        raise RunPaused(f"run {run} is paused by its quality gates: {pause['reason']}. Look at "
                        f"`dflash-pipeline report --run {run}`, then resume with --accept-gates "
                        "or new thresholds (--max-reject-rate, --pause-after)")
    if not pause and not accept and not changed:
        return None
    limits = monitor.thresholds()
    gates_key = redis_keys.RunKeys(run).gates
    checked = count_of(f"{gates_key}:checked", client.hget(gates_key, "checked"), 0)
    rate = max_reject_rate if max_reject_rate is not None else limits.max_reject_rate
    after = pause_after or limits.pause_after
    record = {"accepted": accept, "at": time.time(), "checked": checked,
              "max_reject_rate": rate, "pause_after": after,
              "lifted": pause["reason"] if pause else None}
    storage.put_once(keys.gate_event(run, GateEvent.RESUME, stamp()), dumps(record))
    pipe = client.pipeline(transaction=True)
    limits_now: dict[FieldT, EncodableT] = {"max_reject_rate": rate, "pause_after": after}
    pipe.hset(redis_keys.RunKeys(run).gates, mapping=limits_now)
    if accept:
        pipe.hset(redis_keys.RunKeys(run).gates, "since", 0)
        pipe.delete(redis_keys.RunKeys(run).gate_window)
    pipe.set(redis_keys.RunKeys(run).lifted, events)
    pipe.execute()
    log.info("run %s: gates resumed (accept=%s, max_reject_rate=%s, pause_after=%s)", run, accept,
             record["max_reject_rate"], record["pause_after"])
    return record
