"""Which shards of a stage have a commit, in requests that grow with chunks, not shards.

``CommitSet`` keeps the hidden stage's commits for repeated reads (status, the dashboard);
``committed_shards`` answers once for either stage (resume, the reconciler, enqueue).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common import keys
from common.runs.commit_cache import THREADS
from common.runs.index import (
    CHUNK,
    FEW_HOLES,
    FEW_SHARDS,
    FRONTIER_AHEAD,
    RunIndex,
    chunk_size,
    manifest_shards,
)
from common.storage import Storage


@dataclass
class CommitSet:
    """Shards with a commit under an area (``hidden``), listing only chunks not yet complete."""

    storage: Storage
    run: str
    threads: int = THREADS
    shards: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    listed: set[int] = field(default_factory=set)

    def update(self, total: int) -> set[int]:
        todo = [c for c in range(math.ceil(total / CHUNK)) if c not in self.done]
        jobs = self._warm_jobs(total) if self.listed else None
        if jobs is None:
            jobs = self._chunk_jobs(total, todo)
        if jobs:
            with ThreadPoolExecutor(min(self.threads, len(jobs))) as pool:
                for found in pool.map(lambda job: list(self.storage.list(*job)), jobs):
                    self._add(found)
        for chunk in todo:
            if sum(1 for s in range(chunk * CHUNK, (chunk + 1) * CHUNK) if s in self.shards) \
                    == CHUNK:
                self.done.add(chunk)
        return self.shards

    def _warm_jobs(self, total: int) -> list[tuple[str, str]] | None:
        """Listings (prefix, start after) that find every new commit of a warm set whose
        stage runs mostly in order; None if there are too many gaps for that."""
        area = keys.hidden_prefix(self.run)
        first = next((s for s in range(total) if s not in self.shards), total)
        if first >= total:
            return []
        if sum(1 for s in self.shards if s > first) <= FRONTIER_AHEAD:
            # One LIST from the first shard still missing (a few pages at most).
            return [(area, keys.hidden_shard_prefix(self.run, first).rstrip("/"))]
        last = max(self.shards)
        holes = [s for s in range(first, last) if s not in self.shards]
        if len(holes) > FEW_HOLES:
            return None
        # A few shards missing below the last one known (parked upstream, under way): each
        # listed alone, and one LIST past the last known shard.
        beyond = [(area, keys.hidden_shard_prefix(self.run, last + 1).rstrip("/"))]
        return [(keys.hidden_shard_prefix(self.run, s), "") for s in holes] + (
            beyond if last + 1 < total else [])

    def _chunk_jobs(self, total: int, todo: list[int]) -> list[tuple[str, str]]:
        """One LIST per chunk not yet complete; a chunk listed before with few shards left
        lists just those shards."""
        jobs = []
        for chunk in todo:
            missing = [s for s in range(chunk * CHUNK, chunk * CHUNK + chunk_size(chunk, total))
                       if s not in self.shards]
            jobs += ([(keys.hidden_shard_prefix(self.run, s), "") for s in missing]
                     if chunk in self.listed and len(missing) <= FEW_SHARDS
                     else [(keys.hidden_chunk_prefix(self.run, chunk), "")])
            self.listed.add(chunk)
        return jobs

    def _add(self, listed: Iterable[str]) -> None:
        self.shards |= commits_in(listed)


def commits_in(listed: Iterable[str], area: str = "hidden") -> set[int]:
    """The shards whose ``_COMMIT.json`` in ``area`` is among ``listed`` keys (exact layout)."""
    return {s for k in listed if (s := keys.commit_shard(k, area)) is not None}


def committed_shards(storage: Storage, run: str, stage: str = "generate") -> set[int]:
    """Shards whose ``stage`` (generate or hidden) commit exists, in requests that grow with
    chunks: generate through the index (listing the chunks it does not cover), hidden chunk by
    chunk, concurrently (one listing of a whole area is ~1,000 keys a page, in series). Before
    the manifest gives the shard count, one listing of the stage's area."""
    total = manifest_shards(storage, run)
    if total is None:
        hidden = stage == "hidden"
        area = keys.hidden_prefix(run) if hidden else keys.generated_prefix(run)
        return commits_in(storage.list(area), "hidden" if hidden else "generated")
    if stage == "hidden":
        return set(CommitSet(storage, run).update(total))
    return {shard for read in RunIndex(storage, run, keep=False).scan(total)
            for shard in read.entries}
