"""What a run-index object holds and how a reader proves it: the commits of a chunk, verbatim.

    found = decode_chunk(storage, key, data, run, chunk)     # {shard: (etag, size, body)}
    entry = proven_entry(storage, found[s], listing.identities[s], kind)   # or None
    write_chunk(storage, run, chunk, {shard: (identity, body)})

An object (``runs/<run>/index/commits/chunk-CCCC-NNN-TAG.json.zst``) holds, for each of NNN
committed shards of chunk CCCC, its ``_COMMIT.json`` byte for byte with the commit's identity as
a listing shows it (ETag and size). A reader uses a body only where that identity is the listed
commit's and, on S3, where the body's MD5 is that ETag (S3's ETag of an object put in one piece
is its MD5): no index object can make a reader see other figures than the commit's own, whoever
wrote it. A bucket whose ETags are no MD5s (multipart, SSE-KMS) cannot prove a body: its readers
read the commits. A local directory has one user: there the identity (inode, time, size) is
enough. Derived views (a status digest, a monitor summary) come from the proven body.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import zstandard

from common import keys
from common.errors import DflashError, ForeignObject, SchemaMismatch, StorageRefused
from common.reads import decode_json, decode_json_zst
from common.runs.commit_proof import Bounds, commit_key, prove_commit, run_bounds
from common.runs.schema import COMMIT_SCHEMA, check_schema
from common.runs.schemas import GENERATED_COMMIT, INDEX_CHUNK
from common.storage import LocalStorage, Storage, StoredObject

log = logging.getLogger(__name__)

STORED = "commits"   # the index objects' kind: the commits themselves
DIGESTS, SUMMARIES = "digests", "summaries"   # the views readers take of them
KINDS = (DIGESTS, SUMMARIES)
VERSION = 2
CHUNK = keys.INDEX_CHUNK
Entry = dict[str, Any]
Identity = tuple[str, int]   # a commit as a listing shows it: its ETag and size
_MD5 = re.compile(r"[0-9a-f]{32}", re.ASCII)
_UNPROVABLE: set[str] = set()   # buckets whose ETags are no MD5s (said once per process)


def identity_of(found: StoredObject) -> Identity:
    return found.etag, found.size


def read_commit(storage: Storage, key: str, data: bytes,
                bounds: Bounds | None = None) -> dict[str, Any]:
    """A fetched ``_COMMIT.json``, validated and proven against its run (``bounds``: the run's,
    looked up where not given; :class:`ForeignObject` if it is not one of its shard's)."""
    commit = decode_json(storage, key, data, GENERATED_COMMIT)
    try:
        check_schema(key, commit, COMMIT_SCHEMA)
    except SchemaMismatch as exc:
        raise ForeignObject(key, str(exc)) from None
    if bounds is None:
        bounds = run_bounds(storage, commit_key(key, "generated")[0])
    prove_commit(key, commit, bounds)
    return dict(commit)


def entry_of(kind: str, commit: dict[str, Any]) -> Entry:
    """What a reader of ``kind`` takes of a (validated) commit."""
    if kind == SUMMARIES:
        return dict(commit.get("summary") or {})
    rejected = len(commit.get("rejected_ids", ()))
    return {"samples": len(commit["sample_ids"]) + rejected, "rejected": rejected,
            "stats": commit["stats"], "part_stats": commit.get("part_stats", {}),
            "worker": commit["worker"], "committed_at": commit.get("committed_at", 0.0)}


@dataclass(frozen=True)
class Listing:
    """A chunk as listed: its commits (key and identity) and its parts by shard."""

    commits: dict[int, str] = field(default_factory=dict)
    identities: dict[int, Identity] = field(default_factory=dict)
    parts: dict[int, list[str]] = field(default_factory=dict)

    def add(self, listed: list[StoredObject]) -> None:
        """Sort listed objects into commits and part keys (keys of no exact layout: neither)."""
        for found in listed:
            parsed = keys.parse(found.key)
            if parsed is None or parsed.shard is None:
                continue
            if parsed.kind is keys.KeyKind.COMMIT and parsed.area == "generated":
                self.commits[parsed.shard] = found.key
                self.identities[parsed.shard] = identity_of(found)
            elif parsed.kind is keys.KeyKind.PART:
                self.parts.setdefault(parsed.shard, []).append(found.key)


Stored = tuple[str, int, str]   # a commit in an index object: its ETag, size and body


def provable(storage: Storage, identities: Iterable[Identity]) -> bool:
    """True where a reader can prove stored commits of these identities (a local directory, or
    ETags that are MD5s): elsewhere an index object serves no reader, so none is written."""
    return isinstance(storage, LocalStorage) or all(_MD5.fullmatch(e) for e, _ in identities)


def decode_chunk(storage: Storage, key: str, data: bytes, run: str,
                 chunk: int) -> dict[int, Stored]:
    """An index object's commits by shard; :class:`ForeignObject` unless it is a bounded,
    typed object of this run and chunk holding as many shards of it as its key says."""
    raw = decode_json_zst(storage, key, data, INDEX_CHUNK)
    if (raw["v"], raw["run"], raw["kind"], raw["chunk"]) != (VERSION, run, STORED, chunk):
        raise ForeignObject(key, f"it names {raw['v']}/{raw['run']}/{raw['kind']}/{raw['chunk']}")
    found: dict[int, Stored] = {}
    for name, item in raw["shards"].items():
        etag, size, body = (item.get("etag"), item.get("size"), item.get("body"))
        if not (name.isascii() and name.isdigit() and isinstance(etag, str)
                and isinstance(size, int) and isinstance(body, str)):
            raise ForeignObject(key, f"shard {name[:20]!r} is no (etag, size, body)")
        found[int(name)] = (etag, size, body)
    entry = keys.index_entry(key)
    if entry is None or len(found) != entry[1] or any(s // CHUNK != chunk for s in found):
        raise ForeignObject(key, "its shards do not match its key or chunk")
    return found


def proven_entry(storage: Storage, key: str, stored: Stored, listed: Identity | None,
                 kind: str) -> Entry | None:
    """The view of a stored commit, where it is provably the listed commit; else None (the
    reader reads that commit instead)."""
    etag, size, body = stored
    raw = body.encode()
    if listed != (etag, size) or len(raw) != size:
        return None
    if not isinstance(storage, LocalStorage):
        if not _MD5.fullmatch(etag):
            if storage.root not in _UNPROVABLE:
                _UNPROVABLE.add(storage.root)
                log.warning("%s: its ETags are no MD5s (multipart or SSE-KMS): index objects "
                            "cannot be proven here; readers read the commits", storage.root)
            return None
        if hashlib.md5(raw, usedforsecurity=False).hexdigest() != etag:
            return None
    try:
        return entry_of(kind, read_commit(storage, key, raw))
    except ForeignObject:
        return None


def fresh_tag() -> str:
    """An index object's tag: random, so that no other key can write an honest name first."""
    return uuid.uuid4().hex[:8]


def write_chunk(storage: Storage, run: str, chunk: int,
                commits: dict[int, tuple[Identity, bytes]]) -> str | None:
    """Put one index object of ``commits`` (shard -> its identity and bytes, as read) under a
    fresh random tag; its key, None if refused."""
    held = {}
    for shard, ((etag, size), raw) in sorted(commits.items()):
        try:
            held[str(shard)] = {"etag": etag, "size": size, "body": raw.decode()}
        except UnicodeDecodeError:   # not one of ours: left to direct reads
            continue
    body = orjson.dumps({"v": VERSION, "run": run, "kind": STORED, "chunk": chunk,
                         "shards": held}, option=orjson.OPT_SORT_KEYS)
    shards = held
    data = zstandard.ZstdCompressor(level=3).compress(body)
    for _ in range(3):   # a taken name (~1 in 4e9) is never a silent loss: another tag
        key = keys.index_object(run, STORED, chunk, len(shards), fresh_tag())
        try:
            if storage.put_once(key, data):
                return key
        except StorageRefused as exc:   # a reader's read-only key: derived data, it reads on
            log.debug("run %s: index object %s not written (costs speed only): %s", run, key,
                      exc)
            return None
        except DflashError as exc:  # derived data: reading on costs speed only
            log.warning("run %s: index object %s not written: %s", run, key, exc)
            return None
        log.warning("run %s: index object %s was there already; writing under another tag",
                    run, key)
    return None

