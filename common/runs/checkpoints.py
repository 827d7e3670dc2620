"""Drafter checkpoints in storage: ``runs/<run>/drafter/step-N/{state.pt,_COMMIT.json}``.

A checkpoint holds the trainer's full state (drafter, optimizer, schedule, anchor RNG) and the
**ledger** of what it has consumed: the epoch, shards finished in it and, for the shard in
progress, how many of its rows were trained (:class:`Ledger`). Both files are put-once;
``_COMMIT.json`` is written last and makes the checkpoint real. ``latest.json`` points at the
newest one (a hint: readers fall back to the highest committed step when it is missing or stale).
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from common import keys
from common.errors import ForeignObject, NotFound, SchemaMismatch
from common.reads import note, read_record
from common.runs.records import dumps
from common.runs.schema import CHECKPOINT_SCHEMA, check_schema
from common.runs.schemas import CHECKPOINT_COMMIT
from common.storage import Storage

log = logging.getLogger(__name__)

STATE_FILE, COMMIT_FILE = "state.pt", "_COMMIT.json"


OUT_OF_MEMORY = "out_of_memory"   # a shard's rows set aside after failing alone, checkpointed


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
    finished: str = ""      # why training ended (common.runs.epochs.Finish); "" while it goes on
    # shard -> rows left out of training and why: too_short (too few supervised tokens),
    # too_long (no micro-batch fits them, by the plan or alone out of memory), cut (trained on
    # their first --max-train-tokens)
    set_aside: dict[str, dict[str, int]] = field(default_factory=dict)
    # Steps retried after running out of memory (at half the budget, checkpointing on).
    oom_retries: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "finished": str(self.finished)}   # plain text, never the enum

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ledger:
        return cls(int(data.get("epoch", 0)), [int(s) for s in data.get("done", [])],
                   _ints(data.get("partial")), _ints(data.get("shard_rows")),
                   _ints(data.get("shard_steps")),
                   [None if t is None else float(t) for t in data.get("tau_by_epoch", [])],
                   int(data.get("total_steps", 0)), str(data.get("finished", "")),
                   {str(k): _ints(v) for k, v in (data.get("set_aside") or {}).items()},
                   int(data.get("oom_retries", 0)))

    def set_aside_counts(self) -> dict[str, int]:
        """Rows set aside per reason, over the shards trained so far (rows that ran out of
        memory alone count as too long)."""
        total = {"too_short": 0, "too_long": 0, "cut": 0}
        for counts in self.set_aside.values():
            for reason, n in counts.items():
                reason = "too_long" if reason == OUT_OF_MEMORY else reason
                total[reason] = total.get(reason, 0) + n
        return total

    def rows_done(self, shard: int) -> int:
        return self.partial.get(str(shard), 0)


def checkpoints(storage: Storage, run: str) -> list[tuple[int, int]]:
    """(step, seq) of every committed checkpoint, oldest first (keys of the exact layout only:
    a stray ``_COMMIT.json`` elsewhere under ``drafter/`` is no checkpoint)."""
    found = (keys.checkpoint_id(k) for k in storage.list(keys.drafter_prefix(run)))
    return sorted(c for c in found if c is not None)


def committed_steps(storage: Storage, run: str) -> list[int]:
    """Steps of the committed checkpoints, ascending (a step may hold several)."""
    return sorted({step for step, _ in checkpoints(storage, run)})


def latest_step(storage: Storage, run: str) -> int | None:
    """The step of the newest checkpoint whose commit reads, or None before the first."""
    newest = next(readable_commits(storage, run), None)
    return newest[0][0] if newest else None


def readable_commits(storage: Storage, run: str, step: int | None = None
                     ) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
    """Committed checkpoints (at ``step``), newest first, each with its commit. One whose
    commit is missing, unreadable or of another schema (run.json's own schema was checked
    first, so that is a foreign object) is skipped, with a warning, for the one before it: one
    bad object never costs a run its training."""
    for step_, seq in reversed([c for c in checkpoints(storage, run)
                                if step is None or c[0] == step]):
        key = keys.drafter_checkpoint(run, step_, COMMIT_FILE, seq)
        try:
            commit = read_record(storage, key, CHECKPOINT_COMMIT)
            check_schema(key, commit, CHECKPOINT_SCHEMA)
            Ledger.from_json(commit["ledger"])
            if commit["step"] != step_ or commit.get("seq", seq) != seq:
                raise ValueError(f"it names step {commit.get('step')}.{commit.get('seq')}")
            if commit.get("run", run) != run:   # a commit copied from another run
                raise ValueError(f"it names run {str(commit.get('run'))[:80]!r}")
        except ForeignObject as exc:
            note(exc)
            _skipped(run, key, exc)
            continue
        except (NotFound, SchemaMismatch, ValueError, KeyError, TypeError,
                AttributeError) as exc:
            _skipped(run, key, exc)
            continue
        yield (step_, seq), commit


def _ints(data: Any) -> dict[str, int]:
    """A stored map of counts by shard name (absent: none)."""
    return {str(k): int(v) for k, v in (data or {}).items()}


def _skipped(run: str, key: str, why: Exception) -> None:
    """Warn once per process and checkpoint (readers poll; the trainer warns on each load)."""
    if key not in _SKIPPED:
        _SKIPPED.add(key)
        log.warning("run %s: checkpoint %s skipped, the newest readable one before it serves: "
                    "%s: %s", run, key.rsplit("/", 1)[0], type(why).__name__, why)


_SKIPPED: set[str] = set()


def read_ledger(storage: Storage, run: str) -> Ledger:
    """The ledger of the newest checkpoint (empty before the first)."""
    return ledger_or_none(storage, run) or Ledger()


def ledger_or_none(storage: Storage, run: str) -> Ledger | None:
    """The ledger of the newest readable checkpoint; None before a trainer wrote one."""
    newest = next(readable_commits(storage, run), None)
    return Ledger.from_json(newest[1]["ledger"]) if newest else None


def latest_metrics(storage: Storage, run: str) -> dict[str, Any]:
    """The training metrics the newest readable checkpoint recorded (empty before the first)."""
    newest = next(readable_commits(storage, run), None)
    return (newest[1].get("metrics") or {}) if newest else {}


def metrics_history(storage: Storage, run: str) -> list[dict[str, Any]]:
    """Every readable checkpoint's step and metrics, oldest first (``report`` plots them)."""
    history = [{"step": step, **(commit.get("metrics") or {})}
               for (step, _), commit in readable_commits(storage, run)]
    return history[::-1]


def best_step(storage: Storage, run: str) -> tuple[int, float] | None:
    """The proven checkpoint with the best measured held-out tau, and that tau (the newest of
    equals); None when no checkpoint's tau was measured. A step counts only where a readable
    commit of this run holds its state at the size it states (:func:`proven_steps`): a commit
    that claims a tau for a step with no state behind it never chooses what export loads."""
    steps = proven_steps(storage, run)
    measured: dict[int, float] = {}
    for metrics in metrics_history(storage, run):
        step, tau = _count(metrics.get("tau_step")), _finite(metrics.get("tau"))
        if step is not None and tau is not None and step in steps:
            measured[step] = tau
    if not measured:
        return None
    return max(((step, tau) for step, tau in measured.items()), key=lambda st: (st[1], st[0]))


def proven_steps(storage: Storage, run: str) -> set[int]:
    """Steps with a readable commit whose ``state.pt`` is there, of the size the commit states
    (one listing; the state itself is not read)."""
    sizes: dict[tuple[int, int], int] = {}
    for item in storage.list_objects(keys.drafter_prefix(run)):
        key = keys.parse(item.key)
        if (key is not None and key.kind is keys.KeyKind.CHECKPOINT and key.name == STATE_FILE
                and key.number is not None):
            sizes[(key.number, key.seq)] = item.size
    return {step for (step, seq), commit in readable_commits(storage, run)
            if _count(commit.get("bytes")) == sizes.get((step, seq), -1)}


def _count(value: Any) -> int | None:
    """A stored step or size: a non-negative integer (Redis' text too), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value if isinstance(value, int) and value >= 0 else None


def _finite(value: Any) -> float | None:
    """A stored measure: a finite number (Redis' text too), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


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
    """The trainer state and ledger of the newest readable checkpoint (at ``step``), or None
    before any: one whose state is missing or unreadable is skipped, loudly, for the one before
    it (a trainer never starts over while a readable checkpoint exists)."""
    import pickle

    import torch

    for (step_, seq), commit in readable_commits(storage, run, step):
        key = keys.drafter_checkpoint(run, step_, STATE_FILE, seq)
        try:
            # Bounded by what its commit says it holds (every writer states it): a state is
            # GBs at the user's shape, and one of no stated size is never read unbounded.
            size = int(commit.get("bytes") or 0)
            if size <= 0:
                raise ValueError("its commit states no size for the state")
            data = storage.get(key, limit=size)
            if len(data) != size:
                raise ValueError(f"{len(data):,} bytes where its commit says {size:,}")
            state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
            return state, Ledger.from_json(state.pop("ledger"))
        except (NotFound, RuntimeError, pickle.UnpicklingError, EOFError, ValueError, KeyError,
                TypeError, AttributeError) as exc:
            _skipped(run, key, exc)
    return None
