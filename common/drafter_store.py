"""Drafter checkpoints in storage: ``runs/<run>/drafter/step-N/{state.pt,_COMMIT.json}``.

A checkpoint holds the trainer's full state (drafter, optimizer, schedule, anchor RNG) and the
**ledger** of what it has consumed: the epoch, shards finished in it and, for the shard in
progress, how many of its rows were trained (:class:`Ledger`). Both files are put-once;
``_COMMIT.json`` is written last and makes the checkpoint real. ``latest.json`` points at the
newest one (a hint: readers fall back to the highest committed step when it is missing or stale).
"""

from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from common import keys
from common.errors import NotFound
from common.records import dumps
from common.schema import CHECKPOINT_SCHEMA, check_schema
from common.storage import Storage

log = logging.getLogger(__name__)

STATE_FILE, COMMIT_FILE = "state.pt", "_COMMIT.json"


@dataclass
class Ledger:
    """What a trainer has consumed: the epoch (0-based), whole shards done in it, rows of the
    shard in progress; what a shard yields per epoch (exact once trained); the held-out tau at
    each epoch's end; the schedule's length; and, once training ended, why."""

    epoch: int = 0
    done: list[int] = field(default_factory=list)
    partial: dict[str, int] = field(default_factory=dict)  # shard -> rows already trained
    shard_rows: dict[str, int] = field(default_factory=dict)   # shard -> rows trained per epoch
    shard_steps: dict[str, int] = field(default_factory=dict)  # shard -> steps per epoch
    tau_by_epoch: list[float | None] = field(default_factory=list)
    total_steps: int = 0    # the schedule's length when this ledger was written (0: unknown)
    finished: str = ""      # why training ended (common.epochs.Finish); "" while it goes on

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "finished": str(self.finished)}   # plain text, never the enum

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ledger:
        ints = lambda d: {str(k): int(v) for k, v in (d or {}).items()}  # noqa: E731
        return cls(int(data.get("epoch", 0)), [int(s) for s in data.get("done", [])],
                   ints(data.get("partial")), ints(data.get("shard_rows")),
                   ints(data.get("shard_steps")),
                   [None if t is None else float(t) for t in data.get("tau_by_epoch", [])],
                   int(data.get("total_steps", 0)), str(data.get("finished", "")))

    def rows_done(self, shard: int) -> int:
        return self.partial.get(str(shard), 0)


def checkpoints(storage: Storage, run: str) -> list[tuple[int, int]]:
    """(step, seq) of every committed checkpoint, oldest first."""
    found = (keys.checkpoint_id(k) for k in storage.list(keys.drafter_prefix(run)))
    return sorted(c for c in found if c is not None)


def committed_steps(storage: Storage, run: str) -> list[int]:
    """Steps of the committed checkpoints, ascending (a step may hold several)."""
    return sorted({step for step, _ in checkpoints(storage, run)})


def latest_step(storage: Storage, run: str) -> int | None:
    """The step of the newest committed checkpoint, or None before the first."""
    found = checkpoints(storage, run)
    return found[-1][0] if found else None


def _newest(storage: Storage, run: str, step: int | None) -> tuple[int, int] | None:
    found = [c for c in checkpoints(storage, run) if step is None or c[0] == step]
    return found[-1] if found else None


def read_ledger(storage: Storage, run: str) -> Ledger:
    """The ledger of the newest checkpoint (empty before the first)."""
    return ledger_or_none(storage, run) or Ledger()


def ledger_or_none(storage: Storage, run: str) -> Ledger | None:
    """The ledger of the newest checkpoint; None before a trainer wrote one."""
    newest = _newest(storage, run, None)
    if newest is None:
        return None
    return Ledger.from_json(read_commit(storage, run, *newest)["ledger"])


def read_commit(storage: Storage, run: str, step: int, seq: int) -> dict[str, Any]:
    """A checkpoint's ``_COMMIT.json`` (its ledger and metrics), refused unless its schema is
    the one this release reads."""
    key = keys.drafter_checkpoint(run, step, COMMIT_FILE, seq)
    commit = json.loads(storage.get(key))
    check_schema(key, commit, CHECKPOINT_SCHEMA)
    return commit


def latest_metrics(storage: Storage, run: str) -> dict[str, Any]:
    """The training metrics the newest checkpoint recorded (empty before the first)."""
    newest = _newest(storage, run, None)
    if newest is None:
        return {}
    return read_commit(storage, run, *newest)["metrics"]


def metrics_history(storage: Storage, run: str) -> list[dict[str, Any]]:
    """Every committed checkpoint's step and metrics, oldest first (``report`` plots them)."""
    history = []
    for step, seq in checkpoints(storage, run):
        try:
            commit = read_commit(storage, run, step, seq)
        except NotFound:
            continue
        history.append({"step": step, **commit["metrics"]})
    return history


def best_step(storage: Storage, run: str) -> tuple[int, float] | None:
    """The committed checkpoint with the best measured held-out tau, and that tau (the newest
    of equals); None when no checkpoint's tau was measured."""
    steps = set(committed_steps(storage, run))
    measured: dict[int, float] = {}
    for metrics in metrics_history(storage, run):
        step, tau = metrics.get("tau_step"), metrics.get("tau")
        if step not in (None, "") and tau not in (None, "") and int(step) in steps:
            measured[int(step)] = float(tau)
    if not measured:
        return None
    return max(((step, tau) for step, tau in measured.items()), key=lambda st: (st[1], st[0]))


def train_due(storage: Storage, run: str, upstream: set[int]) -> tuple[set[int], int] | None:
    """Of the ``upstream`` shards, those the trainer has yet to train in its epoch, and that
    epoch (``resume`` and the reconciler queue them); none once training finished; None before
    a trainer wrote its first checkpoint."""
    ledger = ledger_or_none(storage, run)
    if ledger is None:
        return None
    return (set() if ledger.finished else upstream - set(ledger.done)), ledger.epoch


def save_checkpoint(storage: Storage, run: str, step: int, state: dict[str, Any],
                    ledger: Ledger, metrics: dict[str, Any]) -> str:
    """Write state, then the commit, then move ``latest.json``; returns the checkpoint's dir."""
    import torch

    buffer = io.BytesIO()
    torch.save({**state, "ledger": ledger.to_json()}, buffer)
    seq = 0
    while not storage.put_once(keys.drafter_checkpoint(run, step, STATE_FILE, seq),
                               buffer.getvalue()):
        seq += 1  # a checkpoint at this step exists: this one only moves the ledger on
    commit = {"run": run, "step": step, "seq": seq, "ledger": ledger.to_json(),
              "metrics": metrics, "bytes": buffer.tell(), "at": time.time(),
              "schema": CHECKPOINT_SCHEMA}
    storage.put_once(keys.drafter_checkpoint(run, step, COMMIT_FILE, seq), dumps(commit))
    where = keys.drafter_checkpoint(run, step, "", seq).rstrip("/")
    storage.replace(keys.drafter_latest(run), dumps({"step": step, "seq": seq, "dir": where,
                                                     "at": commit["at"]}))
    log.info("run %s: checkpoint %s (%d shards done, %.1f MB)", run, where, len(ledger.done),
             buffer.tell() / 1e6)
    return where


def load_checkpoint(storage: Storage, run: str, step: int | None = None,
                    device: str = "cpu") -> tuple[dict[str, Any], Ledger] | None:
    """The trainer state and ledger at ``step`` (default: the newest), or None before any."""
    import torch

    newest = _newest(storage, run, step)
    if newest is None:
        return None
    try:
        raw = storage.get(keys.drafter_checkpoint(run, newest[0], STATE_FILE, newest[1]))
    except NotFound:
        return None
    state = torch.load(io.BytesIO(raw), map_location=device, weights_only=True)
    return state, Ledger.from_json(state.pop("ledger"))
