"""A generate worker's step after its commit: index the shard's chunk once the chunk is whole.

See :mod:`common.runs.index`; readers index what they had to read themselves, this makes the
index current without any reader.
"""

from __future__ import annotations

import logging

import orjson

from common import keys
from common.errors import DflashError
from common.runs.commit_cache import fetch
from common.runs.index import CHUNK, KINDS, entry_of, manifest_shards, write_chunk
from common.storage import Storage

log = logging.getLogger(__name__)


def index_after_commit(storage: Storage, run: str, shard: int, threads: int = 8) -> None:
    """A worker's step after committing ``shard``: index its chunk if that commit completed it.

    Cheap when it did not (one LIST of the chunk); never fails the commit.
    """
    chunk = shard // CHUNK
    try:
        listed = storage.list(keys.generated_chunk_prefix(run, chunk))
        commits = {s: k for k in listed if (s := keys.commit_shard(k)) is not None}
        first = chunk * CHUNK
        if len(commits) < CHUNK and (set(commits) != set(range(first, first + len(commits)))
                                     or manifest_shards(storage, run) != first + len(commits)):
            return
        missing = [kind for kind in KINDS
                   if not any(keys.index_entry(k) == (chunk, len(commits)) for k in
                              storage.list(f"{keys.index_prefix(run, kind)}chunk-{chunk:04d}-"))]
        if not missing:
            return
        read = {keys.commit_shard(k): orjson.loads(data)
                for k, data in fetch(storage, [commits[s] for s in sorted(commits)], threads)}
        for kind in missing:
            entries = {s: e for s, c in read.items() if (e := entry_of(kind, c)) is not None}
            write_chunk(storage, run, kind, chunk, entries)
    except (DflashError, ValueError, KeyError) as exc:  # derived data: the commit stands
        log.warning("run %s: chunk %d not indexed after shard %d's commit: %s", run, chunk,
                    shard, exc)
