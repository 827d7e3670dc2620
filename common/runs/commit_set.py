"""Which shards of a stage have a commit, in requests that grow with chunks, not shards.

``CommitSet`` keeps the hidden stage's commits for repeated reads (status, the dashboard);
``committed_shards`` answers once for either stage (resume, the reconciler, enqueue). A commit
counts once it is read and proven against its run (:mod:`common.runs.commit_proof`), never from
a listing alone: a foreign one is noted once and left out, and each is read once per set.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common import keys
from common.choices import Stage
from common.errors import ForeignObject, NotFound
from common.reads import bounded_get, decode_json, note
from common.runs.commit_cache import THREADS, fetch, read_commits
from common.runs.commit_proof import KEPT_AT_MOST, Bounds, prove_hidden_commit, run_bounds
from common.runs.index import (
    CHUNK,
    FEW_HOLES,
    FEW_SHARDS,
    FRONTIER_AHEAD,
    RunIndex,
    chunk_size,
    manifest_shards,
)
from common.runs.schemas import HIDDEN_INDEX
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
    refused: set[int] = field(default_factory=set)  # shards whose commit is foreign (noted)

    def update(self, total: int) -> set[int]:
        """The shards with a proven commit, reading only commits not read before."""
        todo = [c for c in range(math.ceil(total / CHUNK)) if c not in self.done]
        found: dict[int, str] = {}
        jobs = self._warm_jobs(total) if self.listed else None
        if jobs is None:
            jobs = self._chunk_jobs(total, todo)
        if jobs:
            with ThreadPoolExecutor(min(self.threads, len(jobs))) as pool:
                for listed in pool.map(lambda job: list(self.storage.list(*job)), jobs):
                    found.update(self._new(listed))
        if found:
            proven = proven_hidden(self.storage, found, run_bounds(self.storage, self.run),
                                   self.threads)
            self.shards |= proven
            self.refused |= set(found) - proven
        known = self.shards | self.refused
        for chunk in todo:
            if sum(1 for s in range(chunk * CHUNK, (chunk + 1) * CHUNK) if s in known) \
                    == CHUNK:
                self.done.add(chunk)
        return self.shards

    def _warm_jobs(self, total: int) -> list[tuple[str, str]] | None:
        """Listings (prefix, start after) that find every new commit of a warm set whose
        stage runs mostly in order; None if there are too many gaps for that."""
        area = keys.hidden_prefix(self.run)
        known = self.shards | self.refused
        first = next((s for s in range(total) if s not in known), total)
        if first >= total:
            return []
        if sum(1 for s in known if s > first) <= FRONTIER_AHEAD:
            # One LIST from the first shard still missing (a few pages at most).
            return [(area, keys.hidden_shard_prefix(self.run, first).rstrip("/"))]
        last = max(known)
        holes = [s for s in range(first, last) if s not in known]
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
                       if s not in self.shards and s not in self.refused]
            jobs += ([(keys.hidden_shard_prefix(self.run, s), "") for s in missing]
                     if chunk in self.listed and len(missing) <= FEW_SHARDS
                     else [(keys.hidden_chunk_prefix(self.run, chunk), "")])
            self.listed.add(chunk)
        return jobs

    def _new(self, listed: Iterable[str]) -> dict[int, str]:
        """The listed hidden commits not read before, by shard."""
        return {s: k for k in listed if (s := keys.commit_shard(k, "hidden")) is not None
                and s not in self.shards and s not in self.refused}


def proven_hidden(storage: Storage, found: Mapping[int, str], bounds: Bounds,
                  threads: int = THREADS) -> set[int]:
    """The shards of ``found`` (shard -> hidden commit key) whose commit reads, bounded and
    typed, as one its shard could have; a foreign one is noted, one gone since listed is not
    counted."""
    get = bounded_get(storage, lambda limits: limits.json_bytes)
    gone: set[str] = set()

    def fetched(key: str) -> bytes:
        try:
            return get(key)
        except NotFound:
            gone.add(key)
            return b""

    proven = set()
    for key, data in fetch(storage, [found[s] for s in sorted(found)], threads, get=fetched):
        if key in gone:
            continue
        try:
            commit = decode_json(storage, key, data, HIDDEN_INDEX)
            prove_hidden_commit(key, commit, bounds)
        except ForeignObject as exc:
            note(exc)
            continue
        proven.add(commit["shard"])
    return proven


@dataclass
class _Kept:
    """A run's hidden commits as this process has proven them (each read once)."""

    found: CommitSet
    lock: threading.Lock = field(default_factory=threading.Lock)


_kept_lock = threading.Lock()
_KEPT: dict[tuple[str, str], _Kept] = {}


def _kept(storage: Storage, run: str) -> _Kept:
    with _kept_lock:
        if len(_KEPT) >= KEPT_AT_MOST:
            _KEPT.clear()
        return _KEPT.setdefault((storage.root, run), _Kept(CommitSet(storage, run)))


def commits_in(listed: Iterable[str], area: str = "hidden") -> set[int]:
    """The shards whose ``_COMMIT.json`` in ``area`` is among ``listed`` keys (exact layout;
    listed, not proven: what to read, never what to count)."""
    return {s for k in listed if (s := keys.commit_shard(k, area)) is not None}


def committed_shards(storage: Storage, run: str, stage: str = Stage.GENERATE) -> set[int]:
    """Shards whose ``stage`` (generate or hidden) commit exists, in requests that grow with
    chunks: generate through the index (listing the chunks it does not cover), hidden chunk by
    chunk, concurrently (one listing of a whole area is ~1,000 keys a page, in series). Before
    the manifest gives the shard count, one listing of the stage's area, each commit read."""
    total = manifest_shards(storage, run)
    if stage == Stage.HIDDEN:
        kept = _kept(storage, run)
        with kept.lock:
            found = kept.found
            found.storage = storage   # the caller's client (a forked reader has its own)
            if total is not None:
                return {s for s in found.update(total) if s < total}
            listed = {s: keys.hidden_commit(run, s) for s in commits_in(storage.list(
                keys.hidden_prefix(run))) if s not in found.shards and s not in found.refused}
            proven = proven_hidden(storage, listed, run_bounds(storage, run))
            found.shards |= proven
            found.refused |= set(listed) - proven
            return set(found.shards)
    if total is None:
        listed_keys = [keys.generated_commit(run, s) for s in sorted(commits_in(
            storage.list(keys.generated_prefix(run)), "generated"))]
        return {commit.shard for commit in read_commits(storage, listed_keys)}
    return {shard for read in RunIndex(storage, run, keep=False).scan(total)
            for shard in read.entries}
