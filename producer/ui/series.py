"""A run's history as time series, from storage alone: ``GET /api/runs/<run>/series``.

Committed shards give one summary per part in their ``_COMMIT.json`` (``part_stats``); asked for
live parts (``?live=1``), parts of uncommitted shards are read once each (they are put-once),
streamed and capped by what an honest part of the run holds (:mod:`common.row_caps`); training
metrics come from the drafter checkpoints' commits. Nothing here reads Redis, so a Redis or
dashboard restart loses no history.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.choices import RowKind
from common.errors import ForeignObject, NotFound
from common.gates.partstats import SampleStat, part_stats
from common.reads import limits_of, note, parse_json, part_getter, read_record, stream_rows
from common.row_caps import RowCaps, row_caps
from common.runs.commit_cache import CommitDigest, fetch
from common.runs.index import RunIndex, manifest_shards, shard_total
from common.runs.records import RunConfig
from common.runs.schemas import CHECKPOINT_COMMIT, SAMPLE
from common.runs.store import RunStore
from common.storage import Storage

log = logging.getLogger(__name__)

MAX_BUCKETS = 240
BUCKETS_S = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400)
SKIPPED_METRICS = {"step", "at", "slot_accuracy"}


@dataclass
class SeriesReader:
    """Reads a run's series; caches what never changes (commits, parts, checkpoints)."""

    storage: Storage
    run: str
    committed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    parts: dict[str, list[SampleStat]] = field(default_factory=dict)
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    index: RunIndex | None = None  # the run index's digests (shared with the dashboard's status)
    total: int = 0  # the run's shard count, once the manifest gave it
    built: tuple[tuple[int, int, bool], dict[str, Any]] | None = None
    caps: RowCaps | None = None  # what a part of this run can hold, once run.json gave it

    def read(self, live: bool = False) -> dict[str, Any]:
        """The series of committed shards; ``live``: with the parts of uncommitted ones."""
        entries = self._entries(live)
        # Commits only add up and a new part adds an entry: the same counts, the same series.
        seen = (len(self.committed), len(entries), live)
        if self.built is None or self.built[0] != seen:
            self.built = (seen, build_series(entries))
        return {"run": self.run, **self.built[1], "train": self._train()}

    def _entries(self, live: bool) -> list[dict[str, Any]]:
        """One entry per part: shard, worker, at, wall_s, samples, rejected, tokens."""
        generated = keys.generated_prefix(self.run)
        self.index = self.index or RunIndex(self.storage, self.run, rejected=True)
        found: dict[int, list[str]] = {}
        self.total = self.total or manifest_shards(self.storage, self.run) or 0
        for read in self.index.scan(self.total or shard_total(self.storage, self.run)):
            if live:
                found.update(read.uncommitted_parts())
        for chunk in self.index.entries.values():
            for shard, entry in chunk.items():
                if shard not in self.committed:
                    self.committed[shard] = _commit_entries(CommitDigest.of_entry(shard, entry))
        for key in [k for k in self.parts if keys.shard_of(k) in self.committed]:
            del self.parts[key]  # the commit's summary replaces what the parts said
        entries = [e for shard_entries in self.committed.values() for e in shard_entries]
        missing = [key for part_keys in found.values() for key in part_keys
                   if key not in self.parts]
        for key, data in fetch(self.storage, missing, get=part_getter(self.storage)):
            self.parts[key] = self._part(key, data)
        for shard, part_keys in found.items():
            known = {k: self.parts[k] for k in part_keys}
            entries += [{"shard": shard, **stats}
                        for stats in part_stats(known, generated).values()]
        return entries

    def _part(self, key: str, data: bytes) -> list[SampleStat]:
        """An uncommitted part's samples as they stream in, capped; a foreign one has none."""
        if self.caps is None:
            self.caps = row_caps(RowKind.SAMPLES, self._config(), limits_of(self.storage))
        try:
            return [SampleStat.of(s) for s in stream_rows(key, data, SAMPLE, self.caps)]
        except ForeignObject as exc:
            note(exc)
            log.info("run %s: part %s left out of the series", self.run, key)
            return []

    def _config(self) -> RunConfig | None:
        """run.json, or None where it is missing or foreign (noted): the default caps apply."""
        try:
            return RunStore(self.storage, self.run).config_or_none()
        except ForeignObject as exc:
            note(exc)
            return None

    def _train(self) -> dict[str, list[Any]]:
        """Numeric metrics of every drafter checkpoint over steps (the newest per step)."""
        for key in self.storage.list(keys.drafter_prefix(self.run)):
            if keys.checkpoint_id(key) is not None and key not in self.checkpoints:
                try:
                    self.checkpoints[key] = read_record(self.storage, key,
                                                           CHECKPOINT_COMMIT)
                except NotFound as exc:
                    log.warning("ignoring checkpoint commit %s: %s", key, exc)
                except ForeignObject as exc:
                    note(exc)
                    self.checkpoints[key] = {}
        by_step: dict[int, dict[str, float]] = {}
        for key in sorted(self.checkpoints, key=_checkpoint_order):
            commit = self.checkpoints[key]
            metrics = commit.get("metrics") or {}
            numeric = {name: value for name, raw in metrics.items()
                       if name not in SKIPPED_METRICS and (value := _number(raw)) is not None}
            slots = _slots(key, metrics.get("slot_accuracy"))
            numeric.update({f"slot{i + 1}_accuracy": a for i, a in enumerate(slots)
                            if a is not None and f"slot{i + 1}_accuracy" not in numeric})
            by_step[int(commit.get("step", _checkpoint_order(key)[0]))] = numeric
        names = sorted({name for values in by_step.values() for name in values})
        steps = sorted(by_step)
        return {"step": steps, **{name: [by_step[s].get(name) for s in steps] for name in names}}


def _commit_entries(commit: CommitDigest) -> list[dict[str, Any]]:
    return [{"shard": commit.shard, **stats} for stats in commit.part_stats.values()]


def _number(raw: Any) -> float | None:
    """A metric as a float (checkpoint metrics are Redis strings), or None if not numeric."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _slots(key: str, raw: Any) -> list[float | None]:
    """A checkpoint's per-slot accuracies (JSON text in its metrics), None where a slot was not
    measured; none at all where they are not a list of numbers (foreign JSON: noted)."""
    try:
        values = parse_json(key, raw) if isinstance(raw, str) else raw
    except ForeignObject as exc:
        note(exc)
        return []
    return [_number(v) for v in values] if isinstance(values, list) else []


def bucket_size(span_s: float) -> int:
    """The smallest round bucket that keeps a series under MAX_BUCKETS points."""
    return next((b for b in BUCKETS_S if span_s / b <= MAX_BUCKETS), BUCKETS_S[-1])


def build_series(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Buckets of the parts: samples done (cumulative), tokens/s (all, per worker), rejections.

    A part's tokens are spread over the seconds it took (its wall time), so the rate does not
    spike at each part write; buckets are aligned to multiples of their size, so the series
    only grows at its end as the run goes.
    """
    timed = [e for e in entries if e.get("at") is not None]
    totals = {"parts": len(entries), "samples": sum(e["samples"] for e in entries),
              "rejected": sum(e["rejected"] for e in entries),
              "tokens": sum(e["tokens"] for e in entries)}
    empty: dict[str, Any] = {"bucket_s": None, "t": [], "samples_done": [], "tokens_per_s": [],
                             "workers": {}, "checked": [], "rejection_rate": [],
                             "totals": totals}
    if not timed:
        return empty
    starts = [e["at"] - (e.get("wall_s") or 0.0) for e in timed]
    t0, t1 = min(starts), max(e["at"] for e in timed)
    size = bucket_size(t1 - t0)
    first = int(t0 // size)
    n = int(t1 // size) - first + 1
    tokens = [0.0] * n
    workers: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    samples, rejected = [0] * n, [0] * n
    for entry, start in zip(timed, starts, strict=True):
        at, worker = entry["at"], entry.get("worker") or "?"
        for i, share in _spread(start, at, size, first, n):
            tokens[i] += entry["tokens"] * share
            workers[worker][i] += entry["tokens"] * share
        i = min(int(at // size) - first, n - 1)
        samples[i] += entry["samples"]
        rejected[i] += entry["rejected"]
    covered = [max(min((first + i + 1) * size, t1) - max((first + i) * size, t0), 1.0)
               for i in range(n)]
    untimed = sum(e["samples"] for e in entries if e.get("at") is None)
    done, cumulative = [], untimed
    for count in samples:
        cumulative += count
        done.append(cumulative)
    return {
        "bucket_s": size,
        "t": [(first + i) * size for i in range(n)],
        "samples_done": done,
        "tokens_per_s": [round(tokens[i] / covered[i], 2) for i in range(n)],
        "workers": {w: [round(v[i] / covered[i], 2) for i in range(n)]
                    for w, v in sorted(workers.items())},
        "checked": samples,
        "rejection_rate": [round(r / s, 4) if s else None for r, s in zip(rejected, samples,
                                                                          strict=True)],
        "totals": totals,
    }


def _spread(start: float, end: float, size: int, first: int, n: int) -> list[tuple[int, float]]:
    """(bucket, share) of the interval [start, end] in each bucket it overlaps."""
    if end - start <= 0:
        return [(min(max(int(end // size) - first, 0), n - 1), 1.0)]
    out = []
    for b in range(int(start // size), int(end // size) + 1):
        overlap = min(end, (b + 1) * size) - max(start, b * size)
        if overlap > 0:
            out.append((min(max(b - first, 0), n - 1), overlap / (end - start)))
    return out


def _checkpoint_order(key: str) -> tuple[int, int]:
    """A checkpoint commit's (step, seq) from its key (every key here names one)."""
    return keys.checkpoint_id(key) or (0, 0)
