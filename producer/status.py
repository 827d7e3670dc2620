"""Run status from storage (commits: the truth) and Redis (leases, live rates: advisory).

``dflash-pipeline status --run RUN [--watch] [--json]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from common import keys
from common.errors import NotFound
from common.monitor import pause_from_storage
from common.records import RunState, ShardCommit
from common.storage import Storage
from producer.enqueue import read_manifest, read_run_config

RATE_WINDOW_S = 120.0


@dataclass
class StatusReader:
    """Reads a run's status; remembers commits already read since they never change."""

    storage: Storage
    client: redis.Redis
    run: str
    commits: dict[int, ShardCommit] = field(default_factory=dict)

    def read(self) -> dict[str, Any]:
        config = read_run_config(self.storage, self.run)
        if config is None:
            raise NotFound(f"run {self.run!r} not found in {self.storage.root}")
        manifest = read_manifest(self.storage, self.run)
        self._read_commits()
        live = self._live()
        total = manifest.shards if manifest else len(list(
            self.storage.list(keys.inputs_prefix(self.run))))
        committed = len(self.commits)
        parked = {s: r for s, r in live["parked"].items() if s not in self.commits}
        running = len(live["running"] - set(self.commits))
        done = sum(c.samples for c in self.commits.values())
        partial = sum(n for s, n in live["partial"].items() if s not in self.commits)
        tokens = sum(c.stats.get("completion_tokens", 0) for c in self.commits.values())
        rows = manifest.rows - manifest.rejected if manifest else None
        remaining = None if rows is None else max(rows - done - partial, 0)
        rate = live["samples_per_s"]
        state = _state(manifest is not None, total, committed, len(parked), running,
                       done + partial)
        gates = self._gates(live)
        pause = live["pause"] if live["ready"] else pause_from_storage(self.storage, self.run)
        if pause and state not in (RunState.DONE, RunState.FAILED):
            state = RunState.PAUSED
        return {
            "run": self.run,
            "state": state.value,
            "storage": self.storage.root,
            "model": config.model,
            "shards": {"total": total, "committed": committed, "running": running,
                       "parked": len(parked),
                       "pending": max(total - committed - running - len(parked), 0)},
            "samples": {"total": rows, "done": done, "in_progress": partial,
                        "rejected": (manifest.rejected if manifest else 0) + gates["rejected"],
                        "input_rejected": manifest.rejected if manifest else 0,
                        "gate_rejected": gates["rejected"]},
            "gates": gates,
            "pause": pause if state is RunState.PAUSED else None,
            "reason": pause["reason"] if pause and state is RunState.PAUSED else None,
            "tokens": {"generated": tokens, "per_s": round(live["tokens_per_s"], 2)},
            "samples_per_s": round(rate, 3),
            "eta_s": round(remaining / rate, 1) if rate > 0 and remaining is not None
            else (0.0 if remaining == 0 else None),
            "parked": [{"shard": s, "reason": r} for s, r in sorted(parked.items())],
            "engines": live["engines"],
            "downstream": self._downstream(config, live),
        }

    def _read_commits(self) -> None:
        for key in self.storage.list(keys.generated_prefix(self.run)):
            shard = keys.shard_of(key)
            if key.endswith("/_COMMIT.json") and shard is not None and shard not in self.commits:
                self.commits[shard] = ShardCommit.from_json(json.loads(self.storage.get(key)))

    def _downstream(self, config: Any, live: dict[str, Any]) -> dict[str, Any]:
        """The hidden-state stage's commits (offline) or the trainer's progress (online)."""
        if config.mode != "online":
            done = {keys.shard_of(k) for k in self.storage.list(keys.hidden_prefix(self.run))
                    if k.endswith("/_COMMIT.json")}
            return {"mode": "offline", "stage": "hidden", "committed": len(done)}
        from common.drafter_store import read_ledger

        train = dict(live["train"])
        if "slot_accuracy" in train:
            train["slot_accuracy"] = json.loads(train["slot_accuracy"])
        return {"mode": "online", "stage": "train",
                "committed": len(read_ledger(self.storage, self.run).done), "train": train}

    def _gates(self, live: dict[str, Any]) -> dict[str, Any]:
        """Quality-gate counts: the run monitor's live ones, else the commits' (after a wipe)."""
        stats = live["gates"]
        if stats.get("ready"):
            checked, rejected = int(stats.get("checked", 0)), int(stats.get("rejected", 0))
            reasons = {k.split(":", 1)[1]: int(v) for k, v in stats.items()
                       if k.startswith("reason:")}
        else:
            checked = sum(c.samples for c in self.commits.values())
            rejected = sum(len(c.rejected_ids) for c in self.commits.values())
            reasons = {}
            for commit in self.commits.values():
                for reason, count in commit.stats.get("rejections", {}).items():
                    reasons[reason] = reasons.get(reason, 0) + count
        return {"checked": checked, "rejected": rejected,
                "rate": round(rejected / checked, 4) if checked else 0.0,
                "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}

    def _live(self) -> dict[str, Any]:
        """Redis-side numbers; empty (not an error) when Redis is unreachable or was wiped."""
        empty: dict[str, Any] = {"running": set(), "parked": {}, "partial": {},
                                 "tokens_per_s": 0.0, "samples_per_s": 0.0, "engines": {},
                                 "gates": {}, "pause": None, "ready": False, "train": {}}
        try:
            leases = self.client.scan_iter(keys.redis_lease_pattern(self.run), count=1000)
            running = {int(k.rsplit("-", 1)[-1]) for k in leases}
            parked = self.client.hgetall(keys.redis_parked(self.run))
            partial = self.client.hgetall(keys.redis_partial(self.run))
            events = self.client.lrange(keys.redis_rate(self.run), 0, -1)
            engines = self.client.hgetall(keys.redis_engines())
            gates = self.client.hgetall(keys.redis_gates(self.run))
            pause = self.client.get(keys.redis_paused(self.run))
            train = self.client.hgetall(keys.redis_stage(self.run, "train", "metrics"))
        except redis.RedisError:
            return empty
        tokens_per_s, samples_per_s = _rates(events)
        return {
            "running": running,
            "parked": {int(k.rsplit("-", 1)[-1]): v for k, v in parked.items()},
            "partial": {int(k.rsplit("-", 1)[-1]): int(v) for k, v in partial.items()},
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples_per_s,
            "engines": {name: json.loads(v) for name, v in engines.items()},
            "gates": gates,
            "pause": json.loads(pause) if pause else None,
            "ready": "ready" in gates,
            "train": train,
        }


def _rates(events: list[str]) -> tuple[float, float]:
    """Tokens/s and samples/s over the recent window of part writes."""
    now = time.time()
    recent = [tuple(map(float, e.split())) for e in events]
    recent = [e for e in recent if now - e[0] <= RATE_WINDOW_S]
    if not recent:
        return 0.0, 0.0
    span = max(now - min(e[0] for e in recent), 1.0)
    return sum(e[1] for e in recent) / span, sum(e[2] for e in recent) / span


def _state(enqueued: bool, total: int, committed: int, parked: int, running: int,
           progressed: int) -> RunState:
    if not enqueued:
        return RunState.ENQUEUING
    if committed == total:
        return RunState.DONE
    if committed + parked == total:
        return RunState.FAILED
    if running or progressed:
        return RunState.RUNNING
    return RunState.PENDING
