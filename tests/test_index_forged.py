"""Forged index objects named to be read first cost speed only and never make storage grow: a
reader passes each bad one by to the next fullest object of its chunk, and a chunk gains at most
one object over five scans of each reader (fresh, kept, ``committed_shards``, status) - none
where an honest one is there already (issue 65, point 2)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from common import keys
from common.reads import forget_foreign
from common.runs.commit_set import committed_shards
from common.runs.index import STORED, RunIndex, identity_of
from common.storage import LocalStorage, Storage, open_storage
from producer.status import StatusReader
from tests.conftest import RedisServer
from tests.test_run_index import commit_shard
from tests.test_run_summary import RUN, _stable, _write_run

SHARDS = 6   # the run's manifest: chunk 0 complete once shards 3-5 commit


@pytest.fixture(scope="module")
def complete(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """The summary run with every shard committed (its worker indexed the chunk)."""
    base = tmp_path_factory.mktemp("forged")
    server = RedisServer(base / "redis")
    server.start()
    storage = LocalStorage(str(base / "storage"))
    _write_run(server.client(), storage)
    for shard in (3, 4, 5):
        commit_shard(storage, shard)
    yield server.client(), base
    server.kill()


def _index(storage: Storage) -> list[str]:
    return list(storage.list(keys.index_prefix(RUN, STORED)))


def _put(storage: Storage, tag: str, data: bytes) -> None:
    """An object at chunk 0 stating the chunk's real count, under a tag that lists first."""
    assert storage.put_once(keys.index_object(RUN, STORED, 0, SHARDS, tag), data)


def _zst(body: object) -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(body).encode())


def _plant(storage: Storage) -> None:
    """One forged object of each kind, each with the real count, each listed before any honest
    one (an honest tag is random hex; these are the lowest)."""
    real = {keys.commit_shard(found.key): (identity_of(found), storage.get(found.key))
            for found in storage.list_objects(keys.generated_prefix(RUN))
            if keys.commit_shard(found.key) is not None}
    assert sorted(real) == list(range(SHARDS))
    honest = {str(s): {"etag": e, "size": n, "body": raw.decode()}
              for s, ((e, n), raw) in real.items()}
    inflated = {}
    for s, item in honest.items():   # the listed identities, forged figures
        commit = json.loads(item["body"])
        commit["stats"]["samples"] = 10**9
        inflated[s] = {**item, "body": json.dumps(commit)}
    bogus = {str(s): {"etag": f"{s:032x}", "size": 11, "body": '{"bogus":1}'}
             for s in range(SHARDS)}
    head = {"v": 2, "run": RUN, "kind": STORED, "chunk": 0}
    _put(storage, "00000000", b"not zstd at all")
    _put(storage, "00000001", _zst({"v": 2}))
    _put(storage, "00000002", _zst({**head, "run": "other", "shards": honest}))
    _put(storage, "00000003", _zst({**head, "chunk": 1, "shards": honest}))
    _put(storage, "00000004", _zst({**head, "shards": inflated}))
    _put(storage, "00000005", _zst({**head, "shards": bogus}))


def _storage(base: Path, where: str, honest: bool, request: Any) -> Storage:
    """A copy of the complete run, indexed (by a reader) only where ``honest``."""
    source = LocalStorage(str(base / "storage"))
    storage = (open_storage(request.getfixturevalue("s3_storage")) if where == "s3"
               else LocalStorage(str(base / f"copy-{where}-{honest}")))
    for key in source.list(f"runs/{RUN}/"):
        if "/index/" not in key:   # a local object's identity is its inode: a copy is another
            storage.put_once(key, source.get(key))
    if honest:   # a reader of the whole chunk indexes it
        assert sorted(_entries(RunIndex(storage, RUN, keep=False))) == list(range(SHARDS))
    assert len(_index(storage)) == (1 if honest else 0)
    return storage


def _entries(index: RunIndex) -> dict[int, Any]:
    return {s: e for read in index.scan(SHARDS) for s, e in read.entries.items()}


@pytest.mark.parametrize("honest", [True, False], ids=["honest-there", "forged-only"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_forged_objects_listed_first_are_passed_by_and_storage_stays_bounded(
        complete, where, honest, request, caplog) -> None:
    forget_foreign()
    client, base = complete
    plain = LocalStorage(str(base / "plain"))
    if not (base / "plain").exists():
        shutil.copytree(base / "storage", base / "plain", ignore=shutil.ignore_patterns("index"))
    commits = RunIndex(plain, RUN, keep=False, bad=set(_index(plain)))   # the commits alone
    truth = _entries(commits)
    assert sorted(truth) == list(range(SHARDS)) and commits.direct == SHARDS
    status = _stable(StatusReader(plain, client, RUN).read())
    assert status.pop("foreign_objects") == {}
    assert status["shards"]["committed"] == SHARDS
    storage = _storage(base, where, honest, request)
    _plant(storage)
    before = len(_index(storage))
    for scan in range(5):   # as status, the reconciler and committed_shards: one per scan
        fresh = RunIndex(storage, RUN, keep=False)
        assert _entries(fresh) == truth
        assert len(_index(storage)) == before + (0 if honest else 1), scan
        # Only the first scan of a chunk without an honest object reads the commits.
        assert fresh.direct == (SHARDS if scan == 0 and not honest else 0), scan
        assert len(fresh.bad) == 6   # every forged one passed by, each remembered
    kept = RunIndex(storage, RUN, rejected=True)
    for _ in range(5):
        assert _entries(kept) == truth and kept.direct == 0
    assert len(kept.bad) == 6
    for _ in range(5):
        assert committed_shards(storage, RUN) == set(truth)
        seen = _stable(StatusReader(storage, client, RUN).read())
        # Each undecodable one counted once; those whose commits fail to prove cost a read.
        assert seen.pop("foreign_objects") == {"index": 4}
        assert seen == status
    # At most one object per change of the chunk's commits: one where only forged ones lay.
    assert len(_index(storage)) == before + (0 if honest else 1)
    assert "ignoring stored object" in caplog.text


def test_a_kept_reader_reads_each_forged_object_once(complete) -> None:
    """A kept reader remembers the objects it found bad: later scans neither read nor count them,
    and it reads the honest one once."""
    _, base = complete
    storage = _storage(base, "kept", True, None)
    _plant(storage)
    kept = RunIndex(storage, RUN)
    gets: list[str] = []
    real_get = kept._get

    def counted(key: str) -> bytes:
        gets.append(key)
        return real_get(key)

    kept._get = counted  # type: ignore[method-assign]
    for _ in range(3):
        assert sorted(_entries(kept)) == list(range(SHARDS)) and kept.direct == 0
    index = _index(storage)
    assert sorted(gets) == sorted(index) and len(index) == 7
    assert kept.bad == {k for k in index if "-00000" in k} and len(kept.bad) == 6


def test_a_chunk_gains_one_object_per_change_of_its_commits(complete) -> None:
    """Kept and fresh readers alike: half the chunk committed, one object; the rest committed,
    one more (a kept reader that read only the new commits leaves it to a fuller reader)."""
    _, base = complete
    source = LocalStorage(str(base / "storage"))
    storage = LocalStorage(str(base / "growing"))
    late = [keys.generated_commit(RUN, s) for s in (3, 4, 5)]
    for key in source.list(f"runs/{RUN}/"):
        if "/index/" not in key and key not in late:
            storage.put_once(key, source.get(key))
    assert sorted(_entries(RunIndex(storage, RUN, keep=False, compact_at=1))) == [0, 1, 2]
    assert len(_index(storage)) == 1
    kept = RunIndex(storage, RUN, compact_at=1)
    for _ in range(2):
        assert sorted(_entries(kept)) == [0, 1, 2] and len(_index(storage)) == 1
    for key in late:
        storage.put_once(key, source.get(key))
    for reader in [kept] * 3 + [RunIndex(storage, RUN, keep=False) for _ in range(3)]:
        assert sorted(_entries(reader)) == list(range(SHARDS))
    assert [keys.index_entry(k) for k in _index(storage)] == [(0, 3), (0, 6)]
