"""Commits are proven against their run before any reader counts them (issue 65, point 6).

Commits a generate (or hidden) key may write, each schema-valid, planted in a real run of 6
shards (3 committed): past the manifest's total, naming another run, more samples than the
shard's rows, a sample twice, parts of another run or shard, a hidden commit that is not JSON.
Status (``--json`` and text), ``committed_shards`` for both stages, ``RunStore``'s reads and the
dataset export read the run's truth; each forged commit is one foreign object.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from common import keys
from common.errors import ForeignObject
from common.hidden.store import HiddenIndex, HiddenPart
from common.monitor.run_monitor import rebuild
from common.queue import redis_keys
from common.reads import foreign_counts, forget_foreign
from common.runs.commit_proof import forget_bounds
from common.runs.commit_set import committed_shards
from common.runs.records import dumps
from common.runs.store import RunStore
from common.storage import LocalStorage, Storage, open_storage
from producer.commands import render_status
from producer.dataset_export import ExportOptions, export_dataset
from producer.status import StatusReader
from producer.ui.views import Views
from tests import test_run_summary
from tests.test_run_summary import GATES, RUN

run = test_run_summary.run  # a run of 6 shards of 16 rows, 0-2 committed, written once


def _copy(base: Path, tmp_path: Path, backend: str, s3_url: str | None) -> Storage:
    """The module's run, copied to a fresh local directory or moto bucket."""
    shutil.copytree(base / "storage", tmp_path / "s")
    if backend == "local":
        return LocalStorage(str(tmp_path / "s"))
    assert s3_url is not None
    storage = open_storage(s3_url)
    for path in sorted((tmp_path / "s").rglob("*")):
        if path.is_file():
            assert storage.put_once(path.relative_to(tmp_path / "s").as_posix(),
                                    path.read_bytes())
    return storage


def _commit(storage: Storage, shard: int) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(storage.get(keys.generated_commit(RUN, shard)))
    return loaded


def _forged(shard: int, ids: list[str], run: str = RUN, part_run: str = RUN,
            part_shard: int | None = None) -> dict[str, Any]:
    """A schema-valid commit of ``ids``, all in one generated part (of ``part_run``'s
    ``part_shard``, the commit's own by default)."""
    part = keys.generated_part(part_run, shard if part_shard is None else part_shard, 0)
    return {"run": run, "shard": shard, "parts": [part], "sample_ids": ids,
            "part_of": dict.fromkeys(ids, part), "stats": {"samples": len(ids)},
            "worker": "forger", "schema": 1}


def _plant(storage: Storage, forged: dict[int, dict[str, Any]]) -> None:
    for shard, body in forged.items():
        assert storage.put_once(keys.generated_commit(RUN, shard), dumps(body))


def _truth(storage: Storage) -> dict[str, Any]:
    commits = [_commit(storage, s) for s in range(3)]
    return {"samples": sum(len(c["sample_ids"]) + len(c["rejected_ids"]) for c in commits),
            "ids": sorted(i for c in commits for i in c["sample_ids"] + c["rejected_ids"]),
            "commits": [RunStore(storage, RUN).commit(s) for s in range(3)]}


def _status(storage: Storage, client: Any) -> dict[str, Any]:
    status = dict(StatusReader(storage, client, RUN).read())
    json.dumps(status, allow_nan=False)   # what status --json prints
    assert render_status(status)   # type: ignore[arg-type]  # the --json dict as RunStatus
    return status


def hidden_commit_body(run: str, shard: int, part_shard: int | None = None) -> bytes:
    """A hidden commit as the hidden worker writes it: one sample's two turns in one part (of
    ``part_shard``, its own shard by default); other tests plant it as a done hidden shard."""
    part = HiddenPart(keys.hidden_part(run, shard if part_shard is None else part_shard, 0),
                      [f"{shard}-1", f"{shard}-1"], [0, 1], [7, 9], 100)
    index = HiddenIndex(run, shard, "dflash", [1, 2], 8, 4, "bfloat16", "m", [part])
    return dumps({**index.to_json(), "committed_at": 1.0, "worker": "h"})


def _hidden(storage: Storage, shard: int, part_shard: int | None = None) -> None:
    assert storage.put_once(keys.hidden_commit(RUN, shard),
                            hidden_commit_body(RUN, shard, part_shard))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_forged_commits_change_no_reader(run: Any, tmp_path: Path, request: Any,
                                         backend: str) -> None:
    client, base = run
    s3_url = request.getfixturevalue("s3_storage") if backend == "s3" else None
    storage = _copy(base, tmp_path, backend, s3_url)
    forget_foreign()
    forget_bounds()
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    before, truth = _status(storage, client), _truth(storage)
    assert before["shards"]["committed"] == 3 and before["samples"]["done"] == truth["samples"]
    other = keys.generated_part("other", 5, 0)   # another run's part, with samples
    assert storage.put_once(other, storage.get(keys.generated_part(RUN, 0, 0)))
    _plant(storage, {
        3: _forged(3, ["3-0"], run="other"),                  # names another run
        4: _forged(4, [f"4-{i}" for i in range(17)]),         # 17 samples, 16 rows
        5: _forged(5, ["0-1", "0-2"], part_run="other"),      # another run's part
        6: _forged(6, ["6-0"]), 99: _forged(99, ["99-0"]),    # past the 6 shards
    })
    _hidden(storage, 0)
    _hidden(storage, 2, part_shard=1)   # another shard's part
    assert storage.put_once(keys.hidden_commit(RUN, 1), b"{not json")

    after = _status(storage, client)
    assert after["shards"] == before["shards"] and after["shards"]["committed"] == 3
    assert after["samples"] == before["samples"]
    assert after["downstream"]["committed"] == 1
    assert committed_shards(storage, RUN) == {0, 1, 2}
    assert committed_shards(storage, RUN, "hidden") == {0}
    store = RunStore(storage, RUN)
    assert [store.commit(s) for s in range(3)] == truth["commits"]
    assert {sample["id"] for s in range(3) for part in store.commit(s).parts
            for sample in store.part_rows(part)} >= set(truth["ids"])
    for shard in (3, 5):
        with pytest.raises(ForeignObject):
            store.commit(shard)
    report = export_dataset(storage, LocalStorage(str(tmp_path / "out")),
                            ExportOptions(run=RUN, format="messages", include_rejected=True))
    exported = [json.loads(line) for f in sorted((tmp_path / "out" / "data").glob("*.jsonl"))
                for line in f.read_text().splitlines()]
    assert report.shards == [0, 1, 2] and report.samples == {"train": truth["samples"]}
    assert sorted(row["id"] for row in exported) == truth["ids"]
    assert foreign_counts() == {"generated": 5, "hidden": 2}   # each once, whoever read it


def test_commits_that_misplace_their_samples_are_foreign(run: Any, tmp_path: Path) -> None:
    client, base = run
    storage = _copy(base, tmp_path, "local", None)
    forget_foreign()
    forget_bounds()
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    before = _status(storage, client)
    rejected = _forged(4, ["4-0"])
    rejected["rejected_ids"] = ["4-1"]
    rejected["part_of"]["4-1"] = keys.generated_part(RUN, 4, 0)   # a rejected id, accepted
    _plant(storage, {3: _forged(3, ["3-0", "3-0"]),              # a sample twice
                     4: rejected,
                     5: _forged(5, ["5-0"], part_shard=0)})      # shard 0's part
    after = _status(storage, client)
    assert after["shards"] == before["shards"] and after["samples"] == before["samples"]
    assert foreign_counts() == {"generated": 3}
    # Before the manifest (no bounds) a listing's commits are read and proven all the same.
    (Path(storage.root) / keys.inputs_manifest(RUN)).unlink()
    forget_bounds()
    assert committed_shards(storage, RUN) == {0, 1, 2}


def test_any_pause_record_and_odd_redis_numbers_render(run: Any, tmp_path: Path) -> None:
    client, base = run
    storage = _copy(base, tmp_path, "local", None)
    forget_foreign()
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    status = _status(storage, client)
    for pause in ({"reason": "r", "window": {}, "examples": [{}]},
                  {"reason": "r", "window": {"rate": "x", "size": None}, "examples": "e"}):
        shown = {**status, "state": "paused", "pause": pause}
        text = render_status(shown)   # type: ignore[arg-type]  # the --json dict as RunStatus
        assert "PAUSED  r" in text and "?" in text
    gates = redis_keys.RunKeys(RUN).gates
    client.hset(gates, mapping={"checked": "1_0", "turns": "nan", "reason:x": "-1"})
    client.rpush(redis_keys.RunKeys(RUN).gate_window, "x")
    client.hset(redis_keys.RunKeys(RUN).partial, mapping={"shard-x": "1", "shard-000003": "z"})
    client.hset(redis_keys.RunKeys(RUN).gate_hist, mapping={"many": "1", "5": "2.5"})
    odd = _status(storage, client)
    assert odd["gates"]["checked"] == 0 and odd["gates"]["reasons"]["x"] == 0
    assert Views(storage, client).gates(RUN)["source"] == "live"
    assert foreign_counts()["redis"] >= 7


def test_hidden_commits_are_read_once_per_process(run: Any, tmp_path: Path) -> None:
    _, base = run
    storage = _copy(base, tmp_path, "local", None)
    for shard in (0, 1):
        _hidden(storage, shard)
    assert storage.put_once(keys.hidden_commit(RUN, 2), b"{not json")
    reads: list[str] = []
    for reader in (storage, LocalStorage(storage.root)):   # two readers of one store
        get = reader.get

        def counted(key: str, *args: Any, _get: Any = get, **kwargs: Any) -> bytes:
            reads.append(key)
            data: bytes = _get(key, *args, **kwargs)
            return data

        reader.get = counted   # type: ignore[method-assign]
        assert committed_shards(reader, RUN, "hidden") == {0, 1}
    assert sorted(k for k in reads if k.endswith("_COMMIT.json")) == sorted(
        keys.hidden_commit(RUN, s) for s in (0, 1, 2))
