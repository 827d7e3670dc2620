"""Run status from storage (commits: the truth) and Redis (leases, live rates: advisory).

``dflash-pipeline status --run RUN [--watch] [--json]``. When Redis is unreachable the live
figures (running shards, rates, ETA, parked shards) are ``null``, never a made-up 0, and
``redis.reachable`` says why; when Redis lost the run monitor's counters (a wipe), samples in
progress and rejections are counted from the stored parts, so no figure goes backwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from common import keys
from common.choices import Mode, RowKind, RunState, ShardState
from common.config import load_settings
from common.drafter.origin import drafter_summary
from common.monitor.run_monitor import pause_from_storage
from common.queue import redis_keys
from common.queue.redis_values import count_of, field_key
from common.reads import foreign_counts, limits_of, part_getter, rows_or_none
from common.row_caps import RowCaps, row_caps
from common.runs.commit_cache import CommitDigest, fetch
from common.runs.commit_set import CommitSet
from common.runs.index import RunIndex, shard_total
from common.runs.records import InputManifest, RunConfig
from common.runs.schemas import SAMPLE
from common.runs.store import RunStore
from common.storage import Storage
from producer.enqueue import read_manifest
from producer.status_live import LiveFigures, read_live
from producer.status_record import (
    Downstream,
    GateCounts,
    GateWindow,
    RunStatus,
    ShardCounts,
    ThinkingCounts,
    TurnCounts,
)
from producer.status_rules import StoredProgress, _eta, _state, shard_state
from producer.status_training import training_status


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
    config: RunConfig | None = None   # run.json and the manifest: put-once, read once
    manifest: InputManifest | None = None

    def read(self) -> RunStatus:
        if self.config is None:  # RunNotFound: one line, exit 1
            self.config = RunStore(self.storage, self.run).config()
        config = self.config
        manifest = self.manifest or read_manifest(self.storage, self.run)
        self.manifest = manifest
        total = manifest.shards if manifest else sum(
            1 for k in self.storage.list(keys.inputs_prefix(self.run))
            if keys.input_shard_of(k) is not None)
        part_keys = self._read_commits(total if manifest else shard_total(self.storage, self.run))
        live = read_live(self.client, self.run, self.lease_ttl, self.commits)
        ready = live is not None and "ready" in live.gates
        committed = len(self.commits)
        done = sum(c.samples for c in self.commits.values())
        tokens = sum(c.stats.get("completion_tokens", 0) for c in self.commits.values())
        stored = None if ready else self._stored_progress(part_keys)
        partial = (stored.samples if stored is not None   # else the monitor is ready: live
                   else sum(n for s, n in (live.partial if live else {}).items()
                            if s not in self.commits))
        gates = self._gates(live if ready else None, stored)
        shards = self._shards(live, total, committed)
        rows = manifest.rows - manifest.rejected if manifest else None
        remaining = None if rows is None else max(rows - done - partial, 0)
        state = _state(manifest is not None, total, committed, shards["parked"] or 0,
                       shards["running"] or 0, done + partial,
                       live.owned_anywhere if live is not None else None)
        pause = (live.pause if live is not None and ready
                 else pause_from_storage(self.storage, self.run))
        if pause and state not in (RunState.DONE, RunState.FAILED):
            state = RunState.PAUSED
        rate = live.samples_per_s if live is not None else None
        paused = pause if state is RunState.PAUSED else None
        status: RunStatus = {
            "run": self.run,
            "state": state,   # a str enum: --json writes its text
            "storage": self.storage.root,
            "model": config.model,
            "redis": {"reachable": live is not None, "monitor_ready": ready},
            "shards": shards,
            "samples": {"total": rows, "done": done, "in_progress": partial,
                        "rejected": (manifest.rejected if manifest else 0) + gates["rejected"],
                        "input_rejected": manifest.rejected if manifest else 0,
                        "gate_rejected": gates["rejected"]},
            "gates": gates,
            "pause": paused,
            "reason": paused["reason"] if paused else None,
            "tokens": {"generated": tokens,
                       "per_s": round(live.tokens_per_s, 2) if live is not None else None},
            "samples_per_s": round(rate, 3) if rate is not None else None,
            "eta_s": _eta(state, remaining, rate),
            "parked": live.parked if live is not None else None,
            "engines": live.engines if live is not None else None,
            # Per worker: its engine's speculative algorithm and mean accept length (null: Redis)
            "speculative": live.speculative if live is not None else None,
            # Per worker: whether it generates the run through the MTP head, and why.
            "mtp": live.mtp if live is not None else None,
            "downstream": self._downstream(config, live, total),
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
        return row_caps(RowKind.SAMPLES, self.config, limits_of(self.storage))

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

    def _shards(self, live: LiveFigures | None, total: int, committed: int) -> ShardCounts:
        """Generate-stage shard counts; the Redis-side ones are None when Redis is down."""
        view = live.stages["generate"] if live is not None else None
        self.grid = {shard: shard_state(shard, set(self.commits), view) for shard in range(total)}

        def count(state: ShardState) -> int | None:
            return None if live is None else sum(v is state for v in self.grid.values())

        return {"total": total, "committed": committed, "uncommitted": max(total - committed, 0),
                "running": count(ShardState.RUNNING), "healing": count(ShardState.HEALING),
                "retrying": count(ShardState.RETRYING), "pending": count(ShardState.PENDING),
                "parked": count(ShardState.PARKED)}

    def _downstream(self, config: RunConfig, live: LiveFigures | None, total: int) -> Downstream:
        """The hidden-state stage's commits (offline) or the trainer's progress (online)."""
        stage = "train" if config.mode is Mode.ONLINE else "hidden"
        parked = len(live.stages[stage].parked) if live is not None else None
        if config.mode is Mode.ONLINE:
            return training_status(self.storage, self.run, config.epochs,
                                   live.train if live is not None else None, parked)
        from common.runs.checkpoints import read_ledger

        self.hidden = self.hidden or CommitSet(self.storage, self.run)
        done = self.hidden.update(total)
        # Training from the stored states, where a trainer has checkpointed.
        return {"mode": "offline", "stage": "hidden", "committed": len(done), "parked": parked,
                "rows_set_aside": read_ledger(self.storage, self.run).set_aside_counts()}

    def _gates(self, live: LiveFigures | None, stored: StoredProgress | None) -> GateCounts:
        """Quality-gate counts: the run monitor's live ones (``live``: its counters are
        ready), else commits' and stored parts'."""
        window: GateWindow | None = None
        turns: TurnCounts | None = None
        modes: ThinkingCounts | None = None
        if live is not None:
            stats, hash_key = live.gates, redis_keys.RunKeys(self.run).gates

            def counter(name: str) -> int:   # a foreign value (noted) reads as 0
                return count_of(field_key(hash_key, name), stats.get(name))

            checked, rejected = counter("checked"), counter("rejected")
            turns = {"judged": counter("turns"), "rejected": counter("turns_rejected")}
            off = counter("thinking_off")
            modes = {"on": max(checked - off, 0), "off": off}
            reasons = {k.split(":", 1)[1]: counter(k) for k in stats if k.startswith("reason:")}
            if outcomes := live.window:
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
