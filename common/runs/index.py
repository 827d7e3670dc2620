"""The run index: put-once objects of commit digests, one per chunk of shards, any worker extends.

Readers of a whole run (status, the dashboard, the monitor's rebuild) would read one commit per
shard. ``runs/<run>/index/<kind>/chunk-CCCC-NNN-TAG.json.zst`` holds what they need of NNN
commits of chunk CCCC (the 100 shards named ``shard-CCCCxx``): ``digests`` (counts, stats,
part stats) or ``summaries`` (the run monitor's share of each shard). It is derived data, the
commits stay the truth: a reader lists the index, reads the fullest object of each chunk, and
lists each chunk it does not know complete yet (one LIST per chunk, by the shards' name prefix),
reading only the commits the object lacks. An object is a hint checked against that listing:
one that names a shard without a commit (forged: every writer's key may write the index) is
ignored whole, so it can never add a committed shard; a lagging, missing, corrupt or forged
object costs speed only. Objects are never overwritten: a key names its set of shards (equal sets,
equal key and bytes), so two writers extending one chunk both land and readers take the
fullest. A worker indexes a chunk when its commit completes it; a reader that had to read
:data:`COMPACT_AT` commits of a chunk directly writes them into a fuller object.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import zstandard

from common import keys
from common.errors import DflashError, NotFound, StorageRefused
from common.key_layout import file_listing
from common.runs.commit_cache import THREADS, fetch
from common.runs.records import InputManifest
from common.runs.schema import COMMIT_SCHEMA, check_schema
from common.storage import Storage

log = logging.getLogger(__name__)

DIGESTS, SUMMARIES = "digests", "summaries"
KINDS = (DIGESTS, SUMMARIES)
VERSION = 1
COMPACT_AT = 16
FEW_SHARDS = 2  # more missing in a listed chunk: one LIST of the chunk (fewer requests)
FRONTIER_AHEAD = 100  # committed shards past the first missing one: one LIST from there
FEW_HOLES = 8  # at most this many missing below the last commit: a LIST each, one past it
FIELDS = {DIGESTS: {"samples", "rejected", "stats", "part_stats", "worker", "committed_at"},
          SUMMARIES: {"v", "judged", "rejected", "reasons", "hist", "groups", "examples",
                      "answers"}}
CHUNK = keys.INDEX_CHUNK
Entry = dict[str, Any]
_IGNORED: set[str] = set()  # forged index objects warned about (once per process)


def chunk_size(chunk: int, total: int) -> int:
    return max(min(CHUNK, total - chunk * CHUNK), 0)


def entry_of(kind: str, commit: dict[str, Any]) -> Entry:
    """What the index keeps of a ``_COMMIT.json`` (parsed) for ``kind``."""
    check_schema(f"runs/{commit.get('run')}/generated/shard {commit.get('shard')} commit", commit,
                 COMMIT_SCHEMA)
    if kind == SUMMARIES:
        return commit["summary"]
    rejected = len(commit["rejected_ids"])
    return {"samples": len(commit["sample_ids"]) + rejected, "rejected": rejected,
            "stats": commit["stats"], "part_stats": commit["part_stats"],
            "worker": commit["worker"], "committed_at": commit["committed_at"]}


def manifest_shards(storage: Storage, run: str) -> int | None:
    """The run's generate shards as its manifest gives them (final); None before it exists."""
    try:
        return InputManifest.from_json(orjson.loads(storage.get(keys.inputs_manifest(run)))).shards
    except NotFound:
        return None


def shard_total(storage: Storage, run: str) -> int:
    """The shards a scan must cover: the manifest's count; before it, the input shards so far,
    rounded up past any chunk that already has generated or rejected objects."""
    shards = manifest_shards(storage, run)
    if shards is not None:
        return shards
    shards = sum(1 for key in storage.list(keys.inputs_prefix(run))
                 if keys.input_shard_of(key) is not None)
    chunk = math.ceil(shards / CHUNK)
    while any(next(iter(storage.list(prefix(run, chunk))), None) for prefix in
              (keys.generated_chunk_prefix, keys.rejected_chunk_prefix)):
        chunk += 1
        shards = chunk * CHUNK
    return shards


def write_chunk(storage: Storage, run: str, kind: str, chunk: int,
                entries: dict[int, dict[str, Any]]) -> str | None:
    """Put one index object of ``entries`` (shards of ``chunk``); its key, None if refused."""
    shards = sorted(entries)
    tag = hashlib.sha1(",".join(map(str, shards)).encode()).hexdigest()[:8]
    key = keys.index_object(run, kind, chunk, len(shards), tag)
    body = orjson.dumps({"v": VERSION, "run": run, "kind": kind, "chunk": chunk,
                         "shards": {str(s): entries[s] for s in shards}},
                        option=orjson.OPT_SORT_KEYS)
    try:
        storage.put_once(key, zstandard.ZstdCompressor(level=3).compress(body))
    except StorageRefused as exc:   # a reader's read-only key: derived data, it reads on
        log.debug("run %s: index object %s not written (costs speed only): %s", run, key, exc)
        return None
    except DflashError as exc:  # derived data: reading on costs speed only
        log.warning("run %s: index object %s not written: %s", run, key, exc)
        return None
    return key


@dataclass(frozen=True)
class ChunkRead:
    """One chunk as a scan found it."""

    chunk: int
    entries: dict[int, Entry]  # committed shard -> its entry
    parts: dict[int, list[str]]  # shard -> part keys, generated then rejected (listed chunks)
    listed: bool  # False: the index covered every shard, storage was not listed

    def uncommitted_parts(self) -> dict[int, list[str]]:
        return {s: p for s, p in self.parts.items() if s not in self.entries}


Listing = tuple[dict[int, str], dict[int, list[str]]]  # a chunk's commits, its parts by shard


@dataclass(frozen=True)
class ScanPlan:
    """What one scan reads: each chunk's fullest index object and the listed chunks."""

    total: int
    best: dict[int, tuple[str, int]]
    todo: list[int]
    listings: dict[int, Listing]

    def fingerprint(self) -> frozenset[str]:
        """Changes exactly when a new index object, commit or part appears."""
        return frozenset([key for key, _ in self.best.values()] + [
            key for commits, parts in self.listings.values()
            for key in [*commits.values(), *(k for p in parts.values() for k in p)]])


@dataclass
class RunIndex:
    """One run's index of one kind; with ``keep``, a cache that reads only what is new."""

    storage: Storage
    run: str
    kind: str = DIGESTS
    keep: bool = True
    rejected: bool = False  # list rejected parts too (for uncommitted shards' progress)
    threads: int = THREADS
    compact_at: int = COMPACT_AT
    entries: dict[int, dict[int, Entry]] = field(default_factory=dict)  # chunk -> shard -> entry
    done: set[int] = field(default_factory=set)  # chunks whose every shard is known
    read_keys: set[str] = field(default_factory=set)  # index objects read (kept)
    bad: set[str] = field(default_factory=set)  # index objects found unreadable
    direct: int = 0  # commits read directly, all scans
    listings: int = 0  # LIST calls, all scans
    listed: set[int] = field(default_factory=set)  # chunks listed in full once (kept)

    def plan(self, total: int) -> ScanPlan:
        """The index listed, then every chunk not known complete (what its objects are checked
        against; a kept chunk with every shard known needs no LIST). Listed in that order, an
        object names no commit the chunk's listing could miss."""
        candidates = self._candidates()
        todo = [c for c in range(math.ceil(total / CHUNK)) if c not in self.done]
        listings = self._list(todo, total)
        best = {}
        for chunk in todo:
            proven = len(set(self.entries.get(chunk, {})) | set(listings[chunk][0]))
            fitting = [(k, n) for k, n in candidates.get(chunk, ()) if n <= proven]
            for key, count in candidates.get(chunk, ()):
                if count > proven:
                    self._ignore(key, f"it counts {count} shards, {proven} have a commit")
            if fitting:  # the fullest that names no more shards than have commits
                best[chunk] = max(fitting, key=lambda kn: kn[1])
        return ScanPlan(total, best, todo, listings)

    def scan(self, total: int, plan: ScanPlan | None = None) -> Iterator[ChunkRead]:
        """Every chunk of ``total`` shards not known complete, in order (kept chunks: skipped)."""
        plan = plan or self.plan(total)
        best, todo, listings = plan.best, plan.todo, plan.listings
        wanted = [best[c][0] for c in todo if c in best and best[c][0] not in self.read_keys]
        objects = fetch(self.storage, wanted, self.threads, get=self._get)
        for chunk in todo:
            known = dict(self.entries.get(chunk, {})) if self.keep else {}
            commits, parts = listings.get(chunk, ({}, {}))
            key = best.get(chunk, ("", 0))[0]
            if key and key not in self.read_keys:
                _, data = next(objects)
                found = self._decode(key, data, chunk)
                if self.keep:
                    self.read_keys.add(key)
                if found is not None and self._proven(key, found, commits, known):
                    known.update({s: e for s, e in found.items() if s not in known})
            self._read_direct(chunk, commits, known, total)
            if self.keep:
                self.entries[chunk] = known
                if len(known) == CHUNK:  # a last chunk may grow until the manifest is out
                    self.done.add(chunk)
            yield ChunkRead(chunk, known, parts, chunk in listings)

    def _read_direct(self, chunk: int, commits: dict[int, str], known: dict[int, Entry],
                     total: int) -> None:
        """Read the chunk's commits the index lacks; index them if that was many (or all)."""
        new = [commits[s] for s in sorted(commits) if s not in known]
        for key, data in fetch(self.storage, new, self.threads):
            known[keys.shard_of(key)] = entry_of(self.kind, orjson.loads(data))
        self.direct += len(new)
        complete = len(commits) == chunk_size(chunk, total)
        if new and (len(new) >= self.compact_at or complete):
            key = write_chunk(self.storage, self.run, self.kind, chunk,
                              {s: e for s, e in known.items() if e is not None})
            if key and self.keep:  # what it holds is known: the next scan need not read it
                self.read_keys.add(key)

    def _proven(self, key: str, found: dict[int, Entry], commits: dict[int, str],
                known: dict[int, Entry]) -> bool:
        """True when the listing shows a commit for every shard the object names (known ones
        were shown before); else the object is ignored whole, with a warning."""
        unproven = sorted(s for s in found if s not in known and s not in commits)
        if unproven:
            self._ignore(key, f"it names {len(unproven)} shard(s) with no commit "
                              f"({', '.join(map(str, unproven[:5]))})")
        return not unproven

    def _ignore(self, key: str, why: str) -> None:
        """Pass over a forged (or foreign) index object: warned once per process."""
        self.bad.add(key)
        if key not in _IGNORED:
            _IGNORED.add(key)
            log.warning("run %s: ignoring index object %s (%s): reading the commits instead",
                        self.run, key, why)

    def _candidates(self) -> dict[int, list[tuple[str, int]]]:
        """chunk -> (key, count) of each of its index objects not found unreadable."""
        found: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for key in self.storage.list(keys.index_prefix(self.run, self.kind)):
            entry = keys.index_entry(key)
            if entry and key not in self.bad:
                found[entry[0]].append((key, entry[1]))
        return found

    def _get(self, key: str) -> bytes:
        try:
            return self.storage.get(key)
        except NotFound:
            return b""

    def _decode(self, key: str, data: bytes, chunk: int) -> dict[int, Entry] | None:
        """The object's entries; None (and a warning) if it is not a valid object of ``key``."""
        try:
            raw = orjson.loads(zstandard.ZstdDecompressor().decompressobj().decompress(data))
            expected = (VERSION, self.run, self.kind, chunk)
            if (raw["v"], raw["run"], raw["kind"], raw["chunk"]) != expected:
                raise ValueError(f"names {raw['v']}/{raw['run']}/{raw['kind']}/{raw['chunk']}")
            found = {int(s): e for s, e in raw["shards"].items()}
            if len(found) != keys.index_entry(key)[1] or any(
                    s // CHUNK != chunk or not isinstance(e, dict)
                    or not FIELDS[self.kind] <= e.keys() for s, e in found.items()):
                raise ValueError("its shards do not match its key or kind")
            return found
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as exc:
            log.warning("run %s: ignoring index object %s (%s): reading its commits", self.run,
                        key, exc)
            self.bad.add(key)
            return None

    def _list(self, chunks: list[int], total: int) -> dict[int, Listing]:
        """The chunks' commits and parts, one LIST per chunk and area, concurrently; a kept
        chunk listed before with few shards left lists just those shards (a warm read lists
        a handful of keys, not the parts of 100 shards)."""
        areas = [keys.generated_prefix(self.run)] + (
            [keys.rejected_prefix(self.run)] if self.rejected else [])
        stems: dict[int, list[str]] = {}
        for chunk in chunks:
            missing = [s for s in range(chunk * CHUNK, chunk * CHUNK + chunk_size(chunk, total))
                       if s not in self.entries.get(chunk, {})]
            few = self.keep and chunk in self.listed and len(missing) <= FEW_SHARDS
            stems[chunk] = ([keys.shard_name(s) + "/" for s in missing] if few
                            else [keys.chunk_stem(chunk)])
            self.listed.add(chunk)
        prefixes = [(c, a + stem) for c in chunks for a in areas for stem in stems[c]]
        if not prefixes:
            return {c: ({}, {}) for c in chunks}
        self.listings += len(prefixes)
        with ThreadPoolExecutor(min(self.threads, len(prefixes)),
                                thread_name_prefix="list") as pool:
            found = list(pool.map(lambda job: list(self.storage.list(job[1])), prefixes))
        out: dict[int, Listing] = {c: ({}, {}) for c in chunks}
        for (chunk, _), listed in zip(prefixes, found, strict=True):
            file_listing(listed, *out[chunk])
        return out
