"""A generate worker's step after its commit: index the shard's chunk once the chunk is whole.

See :mod:`common.runs.index`; readers index what they had to read themselves, this makes the
index current without any reader.
"""

from __future__ import annotations

import logging

from common import keys
from common.errors import DflashError, ForeignObject
from common.reads import bounded_get, note
from common.runs.commit_cache import fetch
from common.runs.index import CHUNK, manifest_shards
from common.runs.index_objects import STORED, Identity, Listing, read_commit, write_chunk
from common.storage import Storage

log = logging.getLogger(__name__)


def index_after_commit(storage: Storage, run: str, shard: int, threads: int = 8) -> None:
    """A worker's step after committing ``shard``: index its chunk if that commit completed it.

    Cheap when it did not (one LIST of the chunk); never fails the commit.
    """
    chunk = shard // CHUNK
    try:
        listing = Listing()
        listing.add(list(storage.list_objects(keys.generated_chunk_prefix(run, chunk))))
        commits = listing.commits
        first = chunk * CHUNK
        if len(commits) < CHUNK and (set(commits) != set(range(first, first + len(commits)))
                                     or manifest_shards(storage, run) != first + len(commits)):
            return
        if any(keys.index_entry(k) == (chunk, len(commits)) for k in
               storage.list(f"{keys.index_prefix(run, STORED)}chunk-{chunk:04d}-")):
            return
        read: dict[int, tuple[Identity, bytes]] = {}
        get = bounded_get(storage, lambda limits: limits.json_bytes)
        for key, data in fetch(storage, [commits[s] for s in sorted(commits)], threads, get=get):
            # A foreign one: no index for this chunk.
            shard_ = int(read_commit(storage, key, data)["shard"])
            read[shard_] = (listing.identities[shard_], data)
        write_chunk(storage, run, chunk, read)
    except ForeignObject as exc:
        note(exc)
    except (DflashError, ValueError, KeyError) as exc:  # derived data: the commit stands
        log.warning("run %s: chunk %d not indexed after shard %d's commit: %s", run, chunk,
                    shard, exc)
