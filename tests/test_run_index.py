"""The run index changes nothing but speed: status, the rebuilt monitor, the stored gate panels
and the series are the same from index objects, from commits and from parts; a corrupt index
object falls back to the commits, a forged one adds no committed shard; concurrent writers never
lose a commit."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.monitor.run_monitor import rebuild
from common.reads import forget_foreign
from common.runs.index import DIGESTS, KINDS, STORED, RunIndex, identity_of, write_chunk
from common.runs.records import InputManifest, ShardTask
from common.runs.store import RunStore
from common.storage import LocalStorage, Storage, open_storage
from embedded.reference_monitor import rebuild_from_parts
from producer.status import StatusReader
from producer.ui.gate_source import stored_gates
from producer.ui.series import SeriesReader
from tests import test_run_summary
from tests.test_commit_proof import hidden_commit_body
from tests.test_run_summary import GATES, RUN, SHARD, _redis_state, _sample, _stable, _write_run
from workers.generate.parts import ShardParts

run = test_run_summary.run  # the same run, written once for this module


def _copy(base: Path, name: str) -> LocalStorage:
    target = base / name
    if not target.exists():
        shutil.copytree(base / "storage", target)
    return LocalStorage(str(target))


def _index_keys(storage: Storage, kind: str = STORED) -> list[str]:
    return list(storage.list(keys.index_prefix(RUN, STORED)))


def _stored(storage: Storage) -> dict[int, tuple[tuple[str, int], bytes]]:
    """Each committed shard's commit as an index object holds it: its identity and bytes."""
    return {keys.commit_shard(found.key): (identity_of(found), storage.get(found.key))
            for found in storage.list_objects(keys.generated_prefix(RUN))
            if keys.commit_shard(found.key) is not None}


def _figures(client: Any, storage: Storage) -> dict[str, Any]:
    """Everything a reader of the run shows: status (Redis wiped, then rebuilt), the rebuilt
    monitor's Redis state, the stored gate panels and the series."""
    client.flushall()
    wiped = _stable(StatusReader(storage, client, RUN).read())
    rebuild(client, storage, RUN, GATES)
    monitor = _redis_state(client)
    status = _stable(StatusReader(storage, client, RUN).read())
    series = SeriesReader(storage, RUN).read()
    return {"wiped": wiped, "monitor": monitor, "status": status, "series": series,
            "gates": stored_gates(storage, RUN, GATES)}


def test_index_commits_and_parts_give_the_same_figures(run) -> None:
    client, base = run
    plain, indexed = _copy(base, "plain"), _copy(base, "indexed")
    # A reader that read every commit directly compacts them: one object serves both views.
    index = RunIndex(indexed, RUN, DIGESTS, keep=False, rejected=True, compact_at=1)
    list(index.scan(6))
    assert index.direct == 3
    assert [keys.index_entry(k) for k in _index_keys(indexed)] == [(0, 3)]
    for kind in KINDS:
        again = RunIndex(indexed, RUN, kind, keep=False)
        assert sorted(s for r in again.scan(6) for s in r.entries) == [0, 1, 2]
        assert again.direct == 0  # every commit came from the index object
    client.flushall()
    rebuild_from_parts(client, plain, RUN, GATES)
    from_parts = _redis_state(client)
    from_index, from_commits = _figures(client, indexed), _figures(client, plain)
    assert from_index == from_commits
    assert from_index["monitor"] == from_parts
    assert from_index["wiped"]["samples"]["in_progress"] == 13
    assert from_index["status"]["gates"]["window"]["rejected"] > 0
    assert from_index["gates"].examples["duplicate"]
    assert not _index_keys(plain)  # 3 direct reads: below the compaction threshold


def test_a_corrupt_index_object_costs_speed_only(run, caplog) -> None:
    client, base = run
    plain, broken = _copy(base, "plain"), _copy(base, "broken")
    # Each claims every shard of the chunk: trusted, it would hide 3-5.
    broken.put_once(keys.index_object(RUN, STORED, 0, 6, "deadbeef"), b"not zstd")
    real = _stored(broken)
    bogus = {s: ((f"{s:032x}", 11), b'{"bogus":1}') for s in range(3)}
    write_chunk(broken, RUN, 0, bogus)  # readable, but not the listed commits
    write_chunk(broken, RUN, 0, {0: (real[1][0], real[0][1])})   # another shard's identity
    broken.put_once(keys.index_object(RUN, STORED, 0, 6, "0badc0de"),
                    json.dumps({"v": 2}).encode())
    assert _figures(client, broken) == _figures(client, plain)
    assert "ignoring stored object" in caplog.text


def commit_shard(storage: Storage, shard: int) -> None:
    """Generate the rest of ``shard`` of the summary run and commit it, as its worker does."""
    parts = ShardParts(storage, ShardTask(RUN, shard))
    parts.refresh()
    done = parts.done_ids
    parts.write([_sample(shard, i, True) for i in range(SHARD) if f"{shard}-{i}" not in done])
    parts.commit([f"{shard}-{i}" for i in range(SHARD)], "w")


def test_the_worker_that_completes_a_chunk_indexes_it(tmp_path: Path, redis_server) -> None:
    storage = LocalStorage(str(tmp_path / "s"))
    _write_run(redis_server.client(), storage)  # 6 shards, 3 committed: no chunk complete
    assert not _index_keys(storage)
    manifest = InputManifest(shards=6, rows=6 * SHARD, rejected=2, shard_rows=[SHARD] * 6)
    assert json.loads(storage.get(keys.inputs_manifest(RUN)))["shards"] == manifest.shards
    reader = StatusReader(storage, redis_server.client(), RUN)
    assert reader.read()["shards"]["committed"] == 3
    for shard in (3, 4, 5):
        commit_shard(storage, shard)
        # A warm reader lists only the shards of the chunk still uncommitted, and sees each.
        assert reader.read()["shards"]["committed"] == shard + 1
    assert [keys.index_entry(k) for k in _index_keys(storage)] == [(0, 6)]
    index = RunIndex(storage, RUN)
    assert len([r for r in index.scan(6)]) == 1
    # One LIST checks the object's shards against the commits; no commit is read directly.
    assert (index.listings, index.direct, index.done) == (1, 0, set())  # the last chunk
    list(index.scan(6))
    assert index.listings == 1  # warm: every shard of the chunk known, nothing listed again
    client = redis_server.client()
    plain = LocalStorage(str(tmp_path / "plain"))
    shutil.copytree(tmp_path / "s", tmp_path / "plain", ignore=shutil.ignore_patterns("index"))
    assert not _index_keys(plain)
    assert _figures(client, storage) == _figures(client, plain)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_forged_index_object_adds_no_committed_shard(run, where, request, caplog,
                                                      monkeypatch) -> None:
    """Every writer's key may write the index: an object naming shards without a commit (well
    formed, its shards within the chunk) is a hint the listing disproves, whole."""
    forget_foreign()   # warned once per process: afresh
    client, base = run
    plain = _copy(base, "plain")
    storage = (LocalStorage(str(base / f"forged-{where}")) if where == "local"
               else open_storage(request.getfixturevalue("s3_storage")))
    for key in plain.list(f"runs/{RUN}/"):
        storage.put_once(key, plain.get(key))
    real = {s: e for r in RunIndex(plain, RUN, keep=False).scan(6) for s, e in r.entries.items()}
    assert sorted(real) == [0, 1, 2]
    stored = _stored(storage)   # 3-5 have parts, no commit: 5 shards, fuller than any real one
    write_chunk(storage, RUN, 0, {0: stored[0], 4: stored[0], 5: stored[1]})  # 3 of them
    fake_real = _stored(storage)
    write_chunk(storage, RUN, 0, {**fake_real, 4: fake_real[0], 5: fake_real[1]})
    for reader in (RunIndex(storage, RUN, keep=False), RunIndex(storage, RUN, rejected=True)):
        assert sorted(s for r in reader.scan(6) for s in r.entries) == [0, 1, 2]
    assert RunStore(storage, RUN).committed() == {0, 1, 2}
    assert "ignoring stored object" in caplog.text and "with no commit (4, 5)" in caplog.text
    statuses = [_stable(StatusReader(s, client, RUN).read()) for s in (storage, plain)]
    assert statuses[0] == statuses[1] and statuses[0]["shards"]["committed"] == 3


@pytest.mark.parametrize("where", ["local", "s3"])
def test_concurrent_writers_never_lose_a_commit(run, where, request) -> None:
    client, base = run
    source = _copy(base, "plain")
    storage = (LocalStorage(str(base / "writers")) if where == "local"
               else open_storage(request.getfixturevalue("s3_storage")))
    for key in source.list(f"runs/{RUN}/"):
        storage.put_once(key, source.get(key))
    entries = {s: e for r in RunIndex(storage, RUN, keep=False).scan(6)
               for s, e in r.entries.items()}
    stored = _stored(storage)   # each commit as this storage lists it, and its bytes
    assert sorted(entries) == [0, 1, 2]
    sets = [{0, 1}, {1, 2}, {0, 1, 2}, {0, 1, 2}]
    barrier = threading.Barrier(len(sets))
    written: list[str | None] = [None] * len(sets)

    def write(i: int) -> None:
        barrier.wait()
        written[i] = write_chunk(storage, RUN, 0, {s: stored[s] for s in sets[i]})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(sets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Every writer lands, under a tag of its own (no key can take another's name first).
    assert None not in written and len(set(written)) == len(sets)
    assert sorted(keys.index_entry(k)[1] for k in _index_keys(storage)) == [2, 2, 3, 3]
    # Readers take the fullest object and read what it lacks from the commits.
    for lacking in ([written[2], written[3]], []):
        index = RunIndex(storage, RUN, rejected=True)
        index.bad.update(lacking)  # as if the full objects were unreadable: a partial one
        found = {s: e for r in index.scan(6) for s, e in r.entries.items()}
        assert found == entries and index.direct == (1 if lacking else 0)
    statuses = [_stable(StatusReader(s, client, RUN).read()) for s in (storage, source)]
    assert statuses[0] == statuses[1]


def test_committed_shards_through_the_index_equal_a_listing_of_the_commits(run) -> None:
    _, base = run
    plain, indexed = _copy(base, "plain"), _copy(base, "committed")
    list(RunIndex(indexed, RUN, keep=False, compact_at=1).scan(6))  # chunk 0 indexed: 3 of 6
    assert [keys.index_entry(k) for k in _index_keys(indexed)] == [(0, 3)]
    listed = {keys.shard_of(k) for k in plain.list(keys.generated_prefix(RUN))
              if k.endswith("/_COMMIT.json")}
    assert listed == {0, 1, 2}
    for storage in (plain, indexed):
        assert RunStore(storage, RUN).committed() == listed
    # A commit the index does not hold yet is found by listing the chunk it lacks.
    late = ShardParts(indexed, ShardTask(RUN, 4))
    late.refresh()
    late.write([_sample(4, i, True) for i in range(SHARD) if f"4-{i}" not in late.done_ids])
    late.commit([f"4-{i}" for i in range(SHARD)], "w")
    assert RunStore(indexed, RUN).committed() == {0, 1, 2, 4}
    for shard in (0, 2):
        indexed.put_once(keys.hidden_part(RUN, shard, 0), b"x")
    indexed.put_once(keys.hidden_commit(RUN, 2), hidden_commit_body(RUN, 2))
    assert RunStore(indexed, RUN).committed("hidden") == {2}


def _chunk(storage: Storage, body: object, count: int, tag: str) -> str:
    """An index object of ``body`` put at chunk 0 with ``count`` shards and ``tag``."""
    import zstandard

    key = keys.index_object(RUN, STORED, 0, count, tag)
    storage.put_once(key, zstandard.ZstdCompressor().compress(json.dumps(body).encode()))
    return key


def test_an_index_object_shows_only_the_listed_commits_own_figures(run, request,
                                                                  caplog) -> None:
    """Every writer's key may write the index. On S3 a stored commit is used only where its
    MD5 is the listed commit's ETag: a forged count for a real shard (its identity copied
    from the listing), an object whose ``shards`` is a list, an older object, change nothing;
    a tag a forger wrote first takes no name from an honest writer."""
    forget_foreign()
    client, base = run
    plain = _copy(base, "plain")
    storage = open_storage(request.getfixturevalue("s3_storage"))
    for key in plain.list(f"runs/{RUN}/"):
        if "/index/" not in key:
            storage.put_once(key, plain.get(key))
    truth = _stable(StatusReader(plain, client, RUN).read())
    real = _stored(storage)
    shards = {}
    for shard, ((etag, size), raw) in real.items():
        commit = json.loads(raw)
        commit["stats"]["samples"] = 10**9
        body = json.dumps(commit, ensure_ascii=False, sort_keys=True, indent=1)
        shards[str(shard)] = {"etag": etag, "size": size, "body": body}
    listed = _chunk(storage, {"v": 2, "run": RUN, "kind": STORED, "chunk": 0, "shards": [0]}, 3,
                    "00000000")   # the list-typed chunk of issue 59, named to be read first
    _chunk(storage, {"v": 2, "run": RUN, "kind": STORED, "chunk": 0, "shards": shards}, 3,
           "00000001")   # the identities a listing shows, forged bodies
    storage.put_once(keys.index_object(RUN, DIGESTS, 0, 3, "00000002"), b"an older object")
    for bad in (set(), {listed}):   # each forged object in turn taken for the fullest
        index = RunIndex(storage, RUN, keep=False)
        index.bad.update(bad)
        found = {s: e for r in index.scan(6) for s, e in r.entries.items()}
        assert sorted(found) == [0, 1, 2] and index.direct == 3
        assert all(e["stats"]["samples"] < 10**9 for e in found.values())
    seen = _stable(StatusReader(storage, client, RUN).read())
    assert seen["samples"] == truth["samples"] and seen["shards"] == truth["shards"]
    assert "not a valid IndexChunk: shards" in caplog.text
    # An honest object is proven by its reader: no commit read. A forger cannot take its name
    # first (its tag is random), so it always lands.
    forged = set(_index_keys(storage))
    honest = write_chunk(storage, RUN, 0, real)
    assert honest is not None and honest not in forged
    again = RunIndex(storage, RUN, keep=False)
    again.bad.update(forged)
    assert {s for r in again.scan(6) for s in r.entries} == {0, 1, 2} and again.direct == 0


def test_a_compression_bomb_or_a_truncated_object_is_foreign(run, caplog) -> None:
    """8 KiB of zstd that would decompress to 256 MiB is refused before a byte is
    decompressed; a truncated frame, a frame that hides its size, an empty body, the same."""
    import tracemalloc

    import zstandard

    from common.reads import foreign_counts

    forget_foreign()
    client, base = run
    storage = _copy(base, "bombs")
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * 256 * 2**20)
    assert len(bomb) < 16 * 2**10   # issue 59's: 8 KiB of zstd, 256 MiB decompressed
    honest = zstandard.ZstdCompressor().compress(json.dumps(
        {"v": 2, "run": RUN, "kind": STORED, "chunk": 0, "shards": {}}).encode())
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(b"{}")
    written = [keys.index_object(RUN, STORED, 0, 1, tag) for tag in
               ("0000000a", "0000000b", "0000000c", "0000000d")]
    for key, body in zip(written, (bomb, honest[:-3], streamed, b""), strict=True):
        storage.put_once(key, body)
    tracemalloc.start()
    for key in written:   # each one in turn the object a reader takes
        index = RunIndex(storage, RUN, keep=False)
        index.bad.update(set(written) - {key})
        assert sorted(s for r in index.scan(6) for s in r.entries) == [0, 1, 2]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 32 * 2**20, peak   # the bomb was never inflated
    assert "decompresses to 268,435,456 bytes" in caplog.text
    assert "truncated or forged" in caplog.text and "does not state its size" in caplog.text
    assert foreign_counts().get("index", 0) == 4


def test_an_honest_writer_that_finds_its_name_taken_writes_under_another(run, monkeypatch,
                                                                          caplog) -> None:
    """Should a forger hit the random tag, the honest object lands under a fresh one, warned."""
    from common.runs import index_objects

    client, base = run
    storage = _copy(base, "taken")
    real = _stored(storage)
    taken = keys.index_object(RUN, STORED, 0, len(real), "feedf00d")
    storage.put_once(taken, b"a forger's object under the honest writer's next name")
    draws = iter(["feedf00d", "c0ffee00"])
    monkeypatch.setattr(index_objects, "fresh_tag", lambda: next(draws))
    written = write_chunk(storage, RUN, 0, real)
    monkeypatch.undo()
    assert written == keys.index_object(RUN, STORED, 0, len(real), "c0ffee00")
    assert f"index object {taken} was there already" in caplog.text
    index = RunIndex(storage, RUN, keep=False)
    index.bad.add(taken)
    assert {s for r in index.scan(6) for s in r.entries} == {0, 1, 2} and index.direct == 0
