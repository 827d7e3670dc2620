"""Every Redis key the pipeline uses, one template per registry, and its lease tokens.

Redis is transport only: everything here can be rebuilt from storage or is advisory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from common.errors import ForeignObject, MalformedName
from common.keys import parse_shard_name, shard_name
from common.reads import note, read_value, value_or_none
from common.runs.schemas import ENGINE, PAUSE, EngineRecord, PauseRecord


def redis_runs() -> str:
    """Set of run ids that have had shards queued: where live workers look for shards to heal."""
    return "dflash:runs"


BEATS_PER_TTL = 3
"""A lease is renewed this many times per TTL."""


def lease_token(owner: str, ttl_ms: int) -> str:
    return f"{owner} {ttl_ms}"


def lease_owner(worker: str, tag: str, shard: int) -> str:
    """A delivery's owner id; it names the shard, so a run-wide lease says which shard it covers."""
    return f"{worker}:{tag}:{shard_name(shard)}"


def lease_shard(token: str | None) -> int | None:
    """The shard a lease token's owner covers (see :func:`lease_owner`), else None."""
    name = (token or "").rpartition(" ")[0].rpartition(":")[2]
    try:
        return parse_shard_name(name)
    except MalformedName:
        return None


def redis_reconciler() -> str:
    """Lock electing the one worker that runs the reconciler pass (``common.queue.reconcile``)."""
    return "dflash:reconciler"


def lease_is_live(token: str | None, pttl_ms: int) -> bool:
    """Whether a lease was renewed lately: a worker that missed two beats is presumed dead."""
    if not token or pttl_ms <= 0:
        return False
    _, _, ttl = token.rpartition(" ")
    try:
        return pttl_ms > int(ttl) / BEATS_PER_TTL * 0.9
    except ValueError:
        return True


class _Key:
    """A registry's key named by its suffix: ``keys.partial`` reads ``dflash:<run>:partial``
    (``<run>:<stage>:`` for a stage's), the template in one place."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __get__(self, keys: _Keyed, owner: object = None) -> str:
        return keys._key(self.what)


class _Keyed(Protocol):
    """A registry that builds its keys from a suffix."""

    def _key(self, what: str) -> str: ...


@dataclass(frozen=True)
class StageKeys:
    """One stage's registries for one run, as rq keeps one key per registry.

    ``queued``: shard -> ``queued|retry|started <epoch>`` while a task message (or a starting
    delivery) stands for it (:mod:`common.queue.dispatch`). ``running``: shard -> owner while a
    worker holds it (a shard here without a live lease lost its worker: it is healed).
    ``attempts``: shard -> deliveries started (the delivery cap counts these). ``parked``:
    shard -> reason. ``lease:shard-N`` (or ``lease:run`` for one-per-run stages): the lease.
    """

    run: str
    stage: str

    def _key(self, what: str) -> str:
        return f"dflash:{self.run}:{self.stage}:{what}"

    queued = _Key("queued")
    running = _Key("running")
    attempts = _Key("attempts")
    parked = _Key("parked")
    metrics = _Key("metrics")
    """Hash of the stage's latest metrics (the trainer's loss, accuracy, tokens/s)."""

    def lease(self, shard: int | None) -> str:
        """The shard's lease, or with ``None`` the stage's one lease per run."""
        return self._key(f"lease:{'run' if shard is None else shard_name(shard)}")

    lease_pattern = _Key("lease:*")


@dataclass(frozen=True)
class RunKeys:
    """Every run-wide Redis key of one run, each ``dflash:<run>:<what>`` (docker/redis/redis.conf's
    ACL selectors and stored state depend on these exact strings)."""

    run: str

    def _key(self, what: str) -> str:
        return f"dflash:{self.run}:{what}"

    partial = _Key("partial")
    """Hash shard -> samples already in parts of a not yet committed shard."""

    rate = _Key("rate")
    """List of recent "timestamp tokens samples" entries, for tokens/s and ETA."""

    requests = _Key("requests")
    """Hash worker name -> engine requests sent for this run."""

    speculative = _Key("speculative")
    """Hash ``algorithm|verify_steps|output_tokens:<worker>`` -> that worker's speculative
    figures for this run (:mod:`common.engine.speculative`)."""

    gates = _Key("gates")
    """Hash of the run monitor's counters (checked, rejected, reason:*, since, thresholds)."""

    gate_window = _Key("gates:window")
    """List of the latest outcomes ("1" rejected, "0" accepted), newest first."""

    gate_hist = _Key("gates:hist")
    """Hash supervised-token count -> turns with that count."""

    def gate_examples(self, reason: str) -> str:
        return self._key(f"gates:examples:{reason}")

    gate_rebuild = _Key("gates:rebuild")
    """Lock held while one worker rebuilds the monitor from storage."""

    answers = _Key("answers")
    """Hash answer hash -> the first sample id that gave that answer (duplicate gate)."""

    answers_order = _Key("answers:order")
    """Hash answer hash -> its owner's judgement order, only while the monitor is rebuilt."""

    pauses = _Key("pauses")
    """List of the quality gates' JSON pause records {reason, examples, at}, newest first:
    the generate user may only LPUSH to it (docker/redis/redis.conf), so its length never
    falls."""

    lifted = _Key("lifted")
    """The length of :attr:`pauses` when ``resume`` last lifted a pause (producer only):
    the run is paused while the list holds more events than this."""

    mtp = _Key("generate:mtp")
    """Hash worker -> JSON {mtp, mode, reason}: whether that worker generates the run
    through the target's MTP head, and why (:mod:`workers.generate.mtp_run`)."""


PUSH_TRIES = 5   # optimistic tries at adding a pause event before it is added regardless
_COUNT = re.compile(r"0|[1-9][0-9]{0,17}", re.ASCII)   # a lift count as resume writes it


def read_pause(pipe: Any, run: str) -> None:
    """Queue on ``pipe`` the three reads whose replies :func:`pause_in` takes."""
    pipe.llen(RunKeys(run).pauses)
    pipe.lindex(RunKeys(run).pauses, 0)
    pipe.get(RunKeys(run).lifted)


def pause_in(run: str, events: int, newest: str | bytes | None,
             lifted: str | bytes | None) -> PauseRecord | None:
    """The pause in force (None: not paused) from :func:`read_pause`'s replies: a pause event
    the last lift did not count. A gate fails closed: an unreadable newest event or lift count,
    or a count past the list's end (the list was removed), is a pause too."""
    text = (lifted.decode(errors="replace") if isinstance(lifted, bytes) else lifted) or "0"
    if text == str(events):
        return None
    count = int(text) if _COUNT.fullmatch(text) else None
    if count is None or count > events:
        why = (f"lifted at {count} of {events} pause events" if count is not None
               else f"a lift count that is no count: {text[:40]!r}")
        note(ForeignObject(RunKeys(run).lifted, why))
        return {"reason": f"unreadable pause record ({why})"}
    return pause_of(RunKeys(run).pauses, newest) or {"reason": "unreadable pause record (empty)"}


def pause_of(key: str, raw: str | bytes | None) -> PauseRecord | None:
    """The pause a Redis value holds (None: no value); one that does not read as a pause
    record still counts as one (a gate fails closed), its reason saying why."""
    if not raw:
        return None
    try:
        pause = read_value(key, raw, PAUSE)
    except ForeignObject as exc:
        note(exc)
        return {"reason": f"unreadable pause record ({exc.why})"}
    return pause.copy()


def push_pause(client: redis.Redis, run: str, record: Mapping[str, object]) -> bool:
    """Add ``record`` to the run's pause events unless a pause is in force (the first caller
    wins: WATCH); the generate user may only add to them, never remove (only ``resume`` lifts)."""
    names = RunKeys(run).pauses, RunKeys(run).lifted
    with client.pipeline(transaction=True) as pipe:
        for _ in range(PUSH_TRIES):
            try:
                pipe.watch(*names)   # type: ignore[no-untyped-call]  # redis-py: unannotated
                events, newest, lifted = (pipe.llen(names[0]), pipe.lindex(names[0], 0),
                                          pipe.get(names[1]))
                if pause_in(run, int(events), newest, lifted) is not None:
                    return False
                pipe.multi()
                pipe.lpush(names[0], json.dumps(record))
                pipe.execute()
                return True
            except redis.WatchError:
                continue
    client.lpush(names[0], json.dumps(record))   # contended throughout: two events are harmless
    return True


def redis_engines() -> str:
    """Hash host:gpu -> JSON {url, log, pid, worker, algorithm} of the engine servers workers
    started (worker: its Celery node; algorithm: its speculative one, or null)."""
    return "dflash:engines"


def engines_of(raw: Mapping[str, str]) -> dict[str, EngineRecord]:
    """The Redis hash of announced engine servers (:func:`redis_engines`)
    as ``{host:gpu: record}``; an entry that is no engine record is noted and left out."""
    found = {}
    for name, value in sorted(raw.items()):
        entry = value_or_none(f"{redis_engines()}:{name}", value, ENGINE)
        if entry is not None:
            found[name] = entry.copy()
    return found
