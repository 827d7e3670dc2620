"""The run index: put-once objects of commit digests, one per chunk of shards, any worker extends.

Readers of a whole run (status, the dashboard, the monitor's rebuild) would read one commit per
shard. ``runs/<run>/index/<kind>/chunk-CCCC-NNN-TAG.json.zst`` holds what they need of NNN
commits of chunk CCCC (the 100 shards named ``shard-CCCCxx``): ``digests`` (counts, stats,
part stats) or ``summaries`` (the run monitor's share of each shard). It is derived data, the
commits stay the truth: a reader lists the index, reads the fullest object of each chunk, and
lists each chunk it does not know complete yet (one LIST per chunk, by the shards' name prefix),
reading only the commits the object lacks. An object is a cache that proves itself against that
listing, cheaply: one that names a shard without a commit (forged: every writer's key may write
the index) is ignored whole, so it can never add a committed shard; each entry carries its
commit's ETag and size as the listing shows them and is used only where they match (else that
commit is read instead), so no entry can stand for another commit than the one listed. Objects
are bounded and typed when read (:mod:`common.reads`); a lagging, missing, corrupt or forged one
costs speed only: a reader passes each bad one by to the next fullest (common.runs.index_choice).
Objects are never overwritten; each is put under a fresh random tag (no other key can take an
honest writer's name first), so two writers extending one chunk both land and readers take the
fullest. A worker indexes a chunk when its commit completes it; a reader that had to read
:data:`COMPACT_AT` commits of a chunk directly writes them (checked: only what it read or
verified) into a fuller object, unless a listed one as full is not known bad.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common import keys
from common.errors import ForeignObject, NotFound
from common.reads import bounded_get, note, read_record
from common.runs.commit_cache import THREADS, fetch
from common.runs.index_choice import Choice, fullest_first, listed_choices, may_write, to_try
from common.runs.index_objects import (  # noqa: F401 - re-exported: the index's one import
    DIGESTS,
    KINDS,
    STORED,
    SUMMARIES,
    Entry,
    Identity,
    Listing,
    Stored,
    decode_chunk,
    entry_of,
    identity_of,
    provable,
    proven_entry,
    read_commit,
    write_chunk,
)
from common.runs.records import InputManifest
from common.runs.schemas import MANIFEST
from common.storage import Storage

log = logging.getLogger(__name__)

COMPACT_AT = 16
FEW_SHARDS = 2  # more missing in a listed chunk: one LIST of the chunk (fewer requests)
FRONTIER_AHEAD = 100  # committed shards past the first missing one: one LIST from there
FEW_HOLES = 8  # at most this many missing below the last commit: a LIST each, one past it
CHUNK = keys.INDEX_CHUNK


def chunk_size(chunk: int, total: int) -> int:
    return max(min(CHUNK, total - chunk * CHUNK), 0)


def manifest_shards(storage: Storage, run: str) -> int | None:
    """The run's generate shards as its manifest gives them (final); None before it exists (or
    where it is foreign)."""
    try:
        return InputManifest.from_json(read_record(storage, keys.inputs_manifest(run),
                                                      MANIFEST)).shards
    except NotFound:
        return None
    except ForeignObject as exc:
        note(exc)
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


@dataclass(frozen=True)
class ChunkRead:
    """One chunk as a scan found it."""

    chunk: int
    entries: dict[int, Entry]  # committed shard -> its entry
    parts: dict[int, list[str]]  # shard -> part keys, generated then rejected (listed chunks)
    listed: bool  # False: the index covered every shard, storage was not listed

    def uncommitted_parts(self) -> dict[int, list[str]]:
        return {s: p for s, p in self.parts.items() if s not in self.entries}


@dataclass(frozen=True)
class ScanPlan:
    """What one scan reads: each chunk's index objects, fullest first, and the listed chunks."""

    total: int
    choices: dict[int, list[Choice]]
    todo: list[int]
    listings: dict[int, Listing]

    def fingerprint(self) -> frozenset[str]:
        """Changes exactly when a new index object, commit or part appears."""
        return frozenset([key for chosen in self.choices.values() for key, _ in chosen] + [
            key for listing in self.listings.values()
            for key in [*listing.commits.values(),
                        *(k for p in listing.parts.values() for k in p)]])


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
    # shard -> its commit's bytes, as read or proven (until its chunk is compacted)
    bodies: dict[int, bytes] = field(default_factory=dict)

    def plan(self, total: int) -> ScanPlan:
        """The index listed, then every chunk not known complete (what its objects are checked
        against; a kept chunk with every shard known needs no LIST). Listed in that order, an
        object names no commit the chunk's listing could miss."""
        candidates = listed_choices(self.storage, self.run, STORED, self.bad)
        todo = [c for c in range(math.ceil(total / CHUNK)) if c not in self.done]
        listings = self._list(todo, total)
        choices = {}
        for chunk in todo:
            proven = len(set(self.entries.get(chunk, {})) | set(listings[chunk].commits))
            fitting, too_full = fullest_first(candidates.get(chunk, ()), proven)
            for key, count in too_full:
                self._ignore(key, f"it counts {count} shards, {proven} have a commit")
            choices[chunk] = fitting
        return ScanPlan(total, choices, todo, listings)

    def scan(self, total: int, plan: ScanPlan | None = None) -> Iterator[ChunkRead]:
        """Every chunk of ``total`` shards not known complete, in order (kept chunks: skipped)."""
        plan = plan or self.plan(total)
        todo, listings = plan.todo, plan.listings
        tries = {c: to_try(plan.choices.get(c, ()), self.read_keys) for c in todo}
        firsts = [tries[c][0] for c in todo if tries[c]]   # fetched ahead, concurrently
        objects = fetch(self.storage, firsts, self.threads, get=self._get)
        for chunk in todo:
            known = dict(self.entries.get(chunk, {})) if self.keep else {}
            listing = listings.get(chunk, Listing())
            if tries[chunk]:
                self._take(chunk, tries[chunk], next(objects)[1], listing, known)
            self._read_direct(chunk, listing, known, total, plan.choices.get(chunk, []))
            if self.keep:
                self.entries[chunk] = known
                if len(known) == CHUNK:  # a last chunk may grow until the manifest is out
                    self.done.add(chunk)
            yield ChunkRead(chunk, known, listing.parts, chunk in listings)

    def _take(self, chunk: int, tries: list[str], data: bytes, listing: Listing,
              known: dict[int, Entry]) -> None:
        """Add the entries of the chunk's fullest good index object to ``known``: each one found
        bad (remembered in ``bad``) passes to the next; what a bad one proves is kept."""
        for i, key in enumerate(tries):
            found = self._decode(key, data if i == 0 else self._get(key), chunk)
            if self.keep:
                self.read_keys.add(key)
            if found is not None and self._proven(key, found, listing.commits, known):
                known.update(self._matching(key, found, listing, known))
                if key not in self.bad:
                    return
                if not provable(self.storage, listing.identities.values()):
                    return   # no object can prove itself here: the next would fail the same

    def _read_direct(self, chunk: int, listing: Listing, known: dict[int, Entry],
                     total: int, choices: list[Choice]) -> None:
        """Read the chunk's commits the index lacks (a foreign one is noted and left out); index
        them if that was many (or all), and no listed object as full is left to read."""
        commits = listing.commits
        new = [commits[s] for s in sorted(commits) if s not in known]
        for key, data in fetch(self.storage, new, self.threads, get=self._commit_get):
            try:
                commit = read_commit(self.storage, key, data)
            except ForeignObject as exc:
                note(exc)
                continue
            shard = int(commit["shard"])   # the key's own: read_commit checked
            known[shard] = entry_of(self.kind, commit)
            self.bodies[shard] = data
        self.direct += len(new)
        complete = len(commits) == chunk_size(chunk, total)
        read = {s: (listing.identities[s], self.bodies[s]) for s in self.bodies
                if s // CHUNK == chunk and s in listing.identities}
        if (read and new and (len(new) >= self.compact_at or complete)
                and may_write(choices, self.bad, len(read))
                and provable(self.storage, (identity for identity, _ in read.values()))):
            # Compaction copies what it read itself, nothing it took on trust.
            written = write_chunk(self.storage, self.run, chunk, read)
            if written and self.keep:  # what it holds is known: the next scan need not read it
                self.read_keys.add(written)
        for shard in list(self.bodies):
            if shard // CHUNK == chunk:
                del self.bodies[shard]

    def _proven(self, key: str, found: dict[int, Stored], commits: dict[int, str],
                known: dict[int, Entry]) -> bool:
        """True when the listing shows a commit for every shard the object names (known ones
        were shown before); else the object is ignored whole, with a warning."""
        unproven = sorted(s for s in found if s not in known and s not in commits)
        if unproven:
            self._ignore(key, f"it names {len(unproven)} shard(s) with no commit "
                              f"({', '.join(map(str, unproven[:5]))})")
        return not unproven

    def _matching(self, key: str, found: dict[int, tuple[str, int, str]], listing: Listing,
                  known: dict[int, Entry]) -> dict[int, Entry]:
        """The object's commits that prove to be the listed ones (common.runs.index_objects):
        another (a forged or an older object's) is ignored, and that commit read instead."""
        good = {}
        for shard, stored in found.items():
            if shard in known or shard not in listing.commits:
                continue
            entry = proven_entry(self.storage, listing.commits[shard], stored,
                                 listing.identities.get(shard), self.kind)
            if entry is not None:
                good[shard] = entry
                self.bodies[shard] = stored[2].encode()
        stale = sorted(set(found) - set(good) - set(known))
        if stale:   # forged, or its commits since replaced: not to be read again, nor counted
            self.bad.add(key)
            log.debug("run %s: index object %s: %d commits do not prove to be the listed ones "
                      "(%s): reading those", self.run, key, len(stale),
                      ", ".join(map(str, stale[:5])))
        return good

    def _ignore(self, key: str, why: str) -> None:
        """Pass over a forged (or foreign) index object: warned once per process, counted."""
        self.bad.add(key)
        note(ForeignObject(key, f"{why}; reading the commits instead"))

    def _get(self, key: str) -> bytes:
        """An index object's bytes, capped (an empty body where it vanished)."""
        try:
            return bounded_get(self.storage, lambda limits: limits.index_bytes)(key)
        except NotFound:
            return b""
        except ForeignObject as exc:
            note(exc)
            return b""

    def _commit_get(self, key: str) -> bytes:
        """A commit's bytes, capped (past the cap: an empty body, which reads as foreign)."""
        try:
            return bounded_get(self.storage, lambda limits: limits.json_bytes)(key)
        except ForeignObject as exc:
            note(exc)
            return b""

    def _decode(self, key: str, data: bytes, chunk: int
                ) -> dict[int, tuple[str, int, str]] | None:
        """The object's stored commits; None (noted: warned once, counted) where it is not a
        bounded, typed index object of this run and chunk (common.runs.index_objects)."""
        try:
            return decode_chunk(self.storage, key, data, self.run, chunk)
        except ForeignObject as exc:
            self.bad.add(key)
            note(exc)
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
            return {c: Listing() for c in chunks}
        self.listings += len(prefixes)
        with ThreadPoolExecutor(min(self.threads, len(prefixes)),
                                thread_name_prefix="list") as pool:
            found = list(pool.map(lambda job: list(self.storage.list_objects(job[1])),
                                  prefixes))
        out: dict[int, Listing] = {c: Listing() for c in chunks}
        for (chunk, _), listed in zip(prefixes, found, strict=True):
            out[chunk].add(listed)
        return out
