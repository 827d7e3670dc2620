"""A run's shards as one listing, and its commits read once each, concurrently.

Commits and parts are put-once, so a reader that keeps what it read only fetches what a new
listing shows; fetches go through a bounded thread pool (S3 answers each GET in tens of ms, and
a run has thousands of commits) and come back in the order asked, a bounded window ahead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from common import keys
from common.errors import ForeignObject
from common.key_layout import file_listing
from common.runs.records import ShardCommit
from common.storage import Storage

log = logging.getLogger(__name__)

THREADS = 16


def fetch(storage: Storage, names: Iterable[str], threads: int = THREADS,
          get: Callable[[str], bytes] | None = None) -> Iterator[tuple[str, bytes]]:
    """``(key, bytes)`` for each key in order, read by ``threads`` at most 2 x threads ahead
    (``get``: how to read one, ``storage.get`` by default)."""
    names = iter(names)
    read = get or storage.get
    with ThreadPoolExecutor(threads, thread_name_prefix="fetch") as pool:
        window: deque[tuple[str, Future[bytes]]] = deque()
        for name in names:
            window.append((name, pool.submit(read, name)))
            if len(window) >= 2 * threads:
                break
        while window:
            name, future = window.popleft()
            following = next(names, None)
            if following is not None:
                window.append((following, pool.submit(read, following)))
            yield name, future.result()


@dataclass(frozen=True)
class RunListing:
    """One listing pass over a run's generated (and rejected) areas."""

    commits: dict[int, str]
    parts: dict[int, list[str]]  # shard -> its part keys, generated then rejected, key order

    @classmethod
    def of(cls, storage: Storage, run: str, rejected: bool = True) -> RunListing:
        commits: dict[int, str] = {}
        parts: dict[int, list[str]] = {}
        areas = [keys.generated_prefix(run)] + ([keys.rejected_prefix(run)] if rejected else [])
        for prefix in areas:
            file_listing(storage.list(prefix), commits, parts)
        return cls(commits, parts)

    def uncommitted_parts(self) -> dict[int, list[str]]:
        return {s: p for s, p in self.parts.items() if s not in self.commits}


@dataclass(frozen=True, slots=True)
class CommitDigest:
    """What status and the series read of a commit (not its per-sample lists)."""

    shard: int
    samples: int
    rejected: int
    stats: dict[str, Any]
    part_stats: dict[str, dict[str, Any]]
    worker: str
    committed_at: float

    @classmethod
    def of_entry(cls, shard: int, entry: dict[str, Any]) -> CommitDigest:
        """From a run-index digest (:func:`common.runs.index.entry_of`; its commit identity
        aside)."""
        return cls(shard, **{k: v for k, v in entry.items() if k != "commit"})

    @classmethod
    def of(cls, commit: ShardCommit) -> CommitDigest:
        return cls(commit.shard, commit.samples, len(commit.rejected_ids), commit.stats,
                   commit.part_stats, commit.worker, commit.committed_at)


def read_commits(storage: Storage, names: Iterable[str],
                 threads: int = THREADS) -> Iterator[ShardCommit]:
    """The commits at ``names``, in that order, read concurrently, each bounded and validated
    (a foreign one is noted and left out)."""
    from common.reads import note, noting_getter
    from common.runs.index_objects import read_commit

    fetched = noting_getter(storage, lambda limits: limits.json_bytes)
    for key, data in fetch(storage, names, threads, get=fetched):
        try:
            yield ShardCommit.from_json(read_commit(storage, key, data))
        except ForeignObject as exc:
            note(exc)
