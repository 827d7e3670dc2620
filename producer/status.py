"""Run status from storage (commits: the truth) and Redis (leases, live rates: advisory).

``dflash-pipeline status --run RUN [--watch] [--json]``. When Redis is unreachable the live
figures (running shards, rates, ETA, parked shards) are ``null``, never a made-up 0, and
``redis.reachable`` says why; when Redis lost the run monitor's counters (a wipe), samples in
progress and rejections are counted from the stored parts, so no figure goes backwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from common import keys
from common.choices import Mode, ShardState
from common.config import load_settings
from common.drafter.origin import drafter_summary
from common.engine.speculative import by_worker, choices_by_worker
from common.monitor.run_monitor import pause_from_storage
from common.queue import redis_keys
from common.queue.celery_app import STAGES, TRAIN
from common.queue.reconcile import read_stage, waiting_messages
from common.queue.redis_values import count_of, field_key, number_of, shard_counts
from common.reads import foreign_counts, limits_of, part_getter, rows_or_none, value_or_none
from common.row_caps import RowCaps, RowKind, row_caps
from common.runs.commit_cache import CommitDigest, fetch
from common.runs.commit_set import CommitSet
from common.runs.index import RunIndex, shard_total
from common.runs.records import RunConfig, RunState
from common.runs.schemas import METRIC_LIST, SAMPLE
from common.runs.store import RunStore
from common.storage import Storage
from producer.enqueue import read_manifest
from producer.status_record import RunStatus
from producer.status_rules import (
    GRID_STATES,
    StoredProgress,
    _eta,
    _owned_anywhere,
    _rates,
    _state,
    shard_state,
    training_progress,
)


@dataclass(frozen=True)
class StoredPart:
    """What status needs of an uncommitted part (parts are put-once: read each once)."""

    ids: frozenset[str]
    rejected: int


@dataclass
class StatusReader:
    """Reads a run's status; remembers commits and parts already read since they never change."""

    storage: Storage
    client: redis.Redis
    run: str
    commits: dict[int, CommitDigest] = field(default_factory=dict)
    parts: dict[str, StoredPart] = field(default_factory=dict)
    lease_ttl: float = field(default_factory=lambda: load_settings().worker.lease_ttl)
    grid: dict[int, ShardState] = field(default_factory=dict)
    """The last read's state of every generate shard (the dashboard's grid)."""
    index: RunIndex | None = None  # the run index's digests (the dashboard shares it)
    hidden: CommitSet | None = None
    fixed: dict[str, Any] = field(default_factory=dict)  # run.json, the manifest: put-once

    def read(self) -> RunStatus:
        if "config" not in self.fixed:  # RunNotFound: one line, exit 1
            self.fixed["config"] = RunStore(self.storage, self.run).config()
        config = self.fixed["config"]
        manifest = self.fixed.get("manifest") or read_manifest(self.storage, self.run)
        self.fixed["manifest"] = manifest
        total = manifest.shards if manifest else sum(
            1 for k in self.storage.list(keys.inputs_prefix(self.run))
            if keys.input_shard_of(k) is not None)
        part_keys = self._read_commits(total if manifest else shard_total(self.storage, self.run))
        found = self._live()
        up = found is not None
        live: dict[str, Any] = found if found is not None else {}   # read only where up
        committed = len(self.commits)
        done = sum(c.samples for c in self.commits.values())
        tokens = sum(c.stats.get("completion_tokens", 0) for c in self.commits.values())
        ready = up and "ready" in live["gates"]
        stored = None if ready else self._stored_progress(part_keys)
        partial = (stored.samples if stored is not None
                   else sum(n for s, n in live["partial"].items() if s not in self.commits))
        gates = self._gates(live["gates"] if ready else None, found, stored)
        shards = self._shards(found, total, committed)
        rows = manifest.rows - manifest.rejected if manifest else None
        remaining = None if rows is None else max(rows - done - partial, 0)
        state = _state(manifest is not None, total, committed, shards["parked"] or 0,
                       shards["running"] or 0, done + partial,
                       _owned_anywhere(live) if up else None)
        pause = live["pause"] if ready else pause_from_storage(self.storage, self.run)
        if pause and state not in (RunState.DONE, RunState.FAILED):
            state = RunState.PAUSED
        rate = live["samples_per_s"] if up else None
        status: RunStatus = {
            "run": self.run,
            "state": state.value,
            "storage": self.storage.root,
            "model": config.model,
            "redis": {"reachable": up, "monitor_ready": ready},
            "shards": shards,
            "samples": {"total": rows, "done": done, "in_progress": partial,
                        "rejected": (manifest.rejected if manifest else 0) + gates["rejected"],
                        "input_rejected": manifest.rejected if manifest else 0,
                        "gate_rejected": gates["rejected"]},
            "gates": gates,
            "pause": pause if state is RunState.PAUSED else None,
            "reason": pause["reason"] if pause and state is RunState.PAUSED else None,
            "tokens": {"generated": tokens,
                       "per_s": round(live["tokens_per_s"], 2) if up else None},
            "samples_per_s": round(rate, 3) if rate is not None else None,
            "eta_s": _eta(state, remaining, rate),
            "parked": live["parked"] if up else None,
            "engines": live["engines"] if up else None,
            # Per worker: its engine's speculative algorithm and mean accept length (null: Redis)
            "speculative": live["speculative"] if up else None,
            # Per worker: whether it generates the run through the MTP head, and why.
            "mtp": live["mtp"] if up else None,
            "downstream": self._downstream(config, found, total),
            # The drafter shape frozen at enqueue (None: the target's, or a worker option's).
            "drafter": drafter_summary(config.drafter, config.target_layer_ids),
            # Stored objects this process met that are no valid record of their key (forged,
            # or written by hand), by area: ignored, warned once each (common/reads.py).
            "foreign_objects": foreign_counts(),
        }
        return status

    def _read_commits(self, total: int) -> list[str]:
        """New commits from the run index (and unindexed commits); returns the part keys of
        uncommitted shards, generated and rejected (for progress after a Redis wipe)."""
        self.index = self.index or RunIndex(self.storage, self.run, rejected=True)
        uncommitted = [key for read in self.index.scan(total)
                       for part_keys in read.uncommitted_parts().values() for key in part_keys]
        for chunk in self.index.entries.values():   # within the total (a kept entry read
            self.commits.update({shard: CommitDigest.of_entry(shard, entry)   # before it: not)
                                 for shard, entry in chunk.items()
                                 if shard not in self.commits and shard < total})
        return uncommitted

    @property
    def _caps(self) -> RowCaps:
        """A part's caps from the run's config (read first by :meth:`read`)."""
        return row_caps(RowKind.SAMPLES, self.fixed.get("config"), limits_of(self.storage))

    def _stored_progress(self, part_keys: list[str]) -> StoredProgress:
        """Samples and rejections in the parts of uncommitted shards, read from storage."""
        keys_ = [key for key in part_keys if keys.shard_of(key) not in self.commits]
        for key, data in fetch(self.storage, [k for k in keys_ if k not in self.parts],
                               get=part_getter(self.storage)):
            samples = rows_or_none(self.storage, key, SAMPLE, data, self._caps) or []  # foreign
            self.parts[key] = StoredPart(frozenset(s["id"] for s in samples),
                                         sum(not s.get("quality", {}).get("passed", True)
                                             for s in samples))
        ids: set[str] = set()
        rejected = 0
        for key in keys_:
            part = self.parts[key]
            rejected += part.rejected if not part.ids <= ids else 0
            ids |= part.ids
        return StoredProgress(len(ids), rejected)

    def _shards(self, live: dict[str, Any] | None, total: int, committed: int) -> dict[str, Any]:
        """Generate-stage shard counts; the Redis-side ones are None when Redis is down."""
        counts: dict[str, Any] = {"total": total, "committed": committed,
                                  "uncommitted": max(total - committed, 0)}
        self.grid = {shard: shard_state(shard, set(self.commits),
                                        live["stages"]["generate"] if live else None)
                     for shard in range(total)}
        if live is None:
            return {**counts, **dict.fromkeys((state.value for state in GRID_STATES), None)}
        return {**counts, **{state.value: sum(v is state for v in self.grid.values())
                             for state in GRID_STATES}}

    def _downstream(self, config: RunConfig, live: dict[str, Any] | None,
                    total: int) -> dict[str, Any]:
        """The hidden-state stage's commits (offline) or the trainer's progress (online)."""
        stage = "train" if config.mode is Mode.ONLINE else "hidden"
        parked = len(live["stages"][stage].parked) if live is not None else None
        from common.runs.checkpoints import latest_metrics, read_ledger

        if config.mode is not Mode.ONLINE:
            self.hidden = self.hidden or CommitSet(self.storage, self.run)
            done = self.hidden.update(total)
            # Training from the stored states, where a trainer has checkpointed.
            return {"mode": "offline", "stage": "hidden", "committed": len(done),
                    "parked": parked,
                    "rows_set_aside": read_ledger(self.storage, self.run).set_aside_counts()}

        train = dict(live["train"]) if live is not None else {}
        if not train:   # Redis lost its record: the newest checkpoint's metrics
            train = dict(latest_metrics(self.storage, self.run))
        ledger = read_ledger(self.storage, self.run)
        train.update(training_progress(train, ledger, config.epochs, TRAIN.keys(self.run).metrics))
        # Steps retried out of memory: the live count, else the newest checkpoint's.
        train["oom_retries"] = _count(train.get("oom_retries"), ledger.oom_retries)
        for name in ("slot_accuracy", "tau_per_position"):
            if isinstance(train.get(name), str):   # JSON text, read as any Redis value
                train[name] = value_or_none(f"{TRAIN.keys(self.run).metrics}:{name}",
                                            train[name], METRIC_LIST)
        metrics = TRAIN.keys(self.run).metrics
        tau = number_of(field_key(metrics, "tau"), train.get("tau"))
        # The periodic eval's last failure, until an eval succeeds (training went on).
        error = ({"message": train["eval_error"], "step": count_of(
            field_key(metrics, "eval_error_step"), train["eval_error_step"])}
                 if train.get("eval_error") and train.get("eval_error_step") else None)
        return {"mode": "online", "stage": "train", "parked": parked,
                "committed": len(ledger.done), "train": train,
                "rows_set_aside": ledger.set_aside_counts(),
                "memory_plan": train.get("memory_plan") or None,
                "finished": ledger.finished or None,
                "tau": tau,
                "tau_step": count_of(field_key(metrics, "tau_step"), train["tau_step"])
                if train.get("tau_step") else None,
                "eval_error": error}

    def _gates(self, stats: dict[str, str] | None, live: dict[str, Any] | None,
               stored: StoredProgress | None) -> dict[str, Any]:
        """Quality-gate counts: the run monitor's live ones, else commits' and stored parts'."""
        window, turns, modes = None, None, None
        if stats is not None:
            hash_key = redis_keys.RunKeys(self.run).gates

            def counter(name: str) -> int:   # a foreign value (noted) reads as 0
                return count_of(field_key(hash_key, name), stats.get(name))

            checked, rejected = counter("checked"), counter("rejected")
            turns = {"judged": counter("turns"), "rejected": counter("turns_rejected")}
            off = counter("thinking_off")
            modes = {"on": max(checked - off, 0), "off": off}
            reasons = {k.split(":", 1)[1]: counter(k) for k in stats if k.startswith("reason:")}
            outcomes = live["window"] if live is not None else []
            if outcomes:
                bad = sum(outcomes)
                window = {"size": len(outcomes), "rejected": bad,
                          "rate": round(bad / len(outcomes), 4)}
        else:
            checked = sum(c.samples for c in self.commits.values())
            rejected = sum(c.rejected for c in self.commits.values())
            if stored is not None:
                checked, rejected = checked + stored.samples, rejected + stored.rejected
            reasons = {}
            for commit in self.commits.values():
                for reason, count in commit.stats.get("rejections", {}).items():
                    reasons[reason] = reasons.get(reason, 0) + count
        # Conversations (checked, rejected: nothing usable) and turns (judged, rejected: a
        # conversation stops at its first rejected turn, the turns before it kept).
        return {"checked": checked, "rejected": rejected,
                "rate": round(rejected / checked, 4) if checked else 0.0,
                "window": window, "turns": turns, "thinking": modes,
                "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}

    def _live(self) -> dict[str, Any] | None:
        """Redis-side numbers; None when Redis is unreachable."""
        try:
            waiting = waiting_messages(self.client)
            stages = {spec.name: read_stage(self.client, spec, self.run, self.lease_ttl, waiting)
                      for spec in STAGES}
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(redis_keys.RunKeys(self.run).partial)
            pipe.lrange(redis_keys.RunKeys(self.run).rate, 0, -1)
            pipe.hgetall(redis_keys.redis_engines())
            pipe.hgetall(redis_keys.RunKeys(self.run).gates)
            pipe.lrange(redis_keys.RunKeys(self.run).gate_window, 0, -1)
            pipe.hgetall(TRAIN.keys(self.run).metrics)
            pipe.hgetall(redis_keys.RunKeys(self.run).speculative)
            pipe.hgetall(redis_keys.RunKeys(self.run).mtp)
            redis_keys.read_pause(pipe, self.run)
            (partial, events, engines, gates, window, train, spec, mtp,
             *pause) = pipe.execute()
        except redis.RedisError:
            return None
        tokens_per_s, samples_per_s = _rates(events)
        return {
            "stages": stages,
            "parked": [{"stage": stage, "shard": s, "reason": r}
                       for stage, info in stages.items()
                       for s, r in sorted(info.parked.items())
                       if stage != "generate" or s not in self.commits],
            "partial": shard_counts(redis_keys.RunKeys(self.run).partial, partial),
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples_per_s,
            "engines": redis_keys.engines_of(engines),
            "gates": gates,
            "window": [count_of(redis_keys.RunKeys(self.run).gate_window, x) for x in window],
            "pause": redis_keys.pause_in(self.run, *pause),
            "train": train,
            "speculative": by_worker(spec),
            "mtp": choices_by_worker(mtp),
        }


def _count(value: Any, fallback: int) -> int:
    """A counter from the metrics record (text in Redis), else ``fallback``."""
    try:
        return int(value) if value not in (None, "") else fallback
    except (TypeError, ValueError):
        return fallback
