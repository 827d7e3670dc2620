"""Schema-valid objects a role may write leave every reader standing (issue 65, a review).

A real run of 6 shards (3 committed, :mod:`tests.test_run_summary`) gets what a generate key, a
hidden key or a train key may write, each valid by its record's schema: samples with no token
ids, a message with no role, a lone surrogate, text that is no text, a token id no vocabulary
holds; hidden commits with a field more or ``format`` left out; trainer metrics in Redis and in a
checkpoint commit that are no numbers. Training rows, the dataset export (every format),
``read_hidden_commit``, ``status`` (``--json`` and text), the dashboard and ``report`` read the
exact counts, and nothing raises.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import zstandard

from common import keys
from common.hidden.store import read_hidden_commit
from common.monitor.run_monitor import rebuild
from common.queue.celery_app import TRAIN
from common.reads import foreign_counts, forget_foreign
from common.runs.commit_proof import forget_bounds
from common.runs.records import dumps
from common.runs.store import RunStore
from common.storage import LocalStorage
from producer.commands import render_status
from producer.dataset_export import ExportOptions, export_dataset
from producer.report import drafter_history
from producer.status import StatusReader
from producer.ui.views import Views
from tests import test_run_summary
from tests.test_commit_proof import hidden_commit_body
from tests.test_run_summary import GATES, RUN

run = test_run_summary.run  # a run of 6 shards of 16 rows, 0-2 committed, written once

ROLES = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def _storage(run: Any, tmp_path: Path) -> tuple[Any, LocalStorage]:
    client, base = run
    shutil.copytree(base / "storage", tmp_path / "s")
    storage = LocalStorage(str(tmp_path / "s"))
    forget_foreign()
    forget_bounds()
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    return client, storage


def _part(storage: LocalStorage, shard: int, index: int, rows: list[dict[str, Any]]) -> str:
    key = keys.generated_part(RUN, shard, index)
    text = b"".join(json.dumps(row).encode() + b"\n" for row in rows)   # surrogates escaped
    assert storage.put_once(key, zstandard.ZstdCompressor().compress(text))
    return key


def _exported(storage: LocalStorage, out: Path, fmt: str) -> list[str]:
    report = export_dataset(storage, LocalStorage(str(out)), ExportOptions(run=RUN, format=fmt))
    assert report.shards == [0, 1, 2, 3]
    if fmt == "parquet":
        return sorted(row["id"] for f in sorted((out / "data").glob("*.parquet"))
                      for row in pq.read_table(f).to_pylist())
    return sorted(json.loads(line)["id"] for f in sorted((out / "data").glob("*.jsonl"))
                  for line in f.read_text().splitlines())


def test_samples_a_schema_lets_through_train_and_export_what_they_hold(
        run: Any, tmp_path: Path) -> None:
    _, storage = _storage(run, tmp_path)
    ids = {"prompt_ids": [1, 2], "output_ids": [3]}
    kept = _part(storage, 3, 90, [
        {"id": "3-0", "messages": ROLES},                                    # no token ids
        {"id": "3-1", "messages": [{"role": "user", "content": "\ud800"}], **ids},
        {"id": "3-2", "messages": [{"content": "no role"}], **ids},
        {"id": "3-3", "messages": [{"role": "user", "content": 5}], **ids, "turns": []},
        {"id": "3-4", "messages": ROLES, **ids, "thinking": True},          # every format
    ])
    vast = _part(storage, 3, 91, [{"id": "3-5", "messages": ROLES, "prompt_ids": [2**40],
                                  "output_ids": [2**63 + 5]}])   # no vocabulary: foreign
    committed = ["3-0", "3-1", "3-2", "3-3", "3-4", "3-5"]
    assert storage.put_once(keys.generated_commit(RUN, 3), dumps({
        "run": RUN, "shard": 3, "parts": [kept, vast], "sample_ids": committed,
        "part_of": {**dict.fromkeys(committed[:5], kept), "3-5": vast},
        "stats": {"samples": 6}, "worker": "forger", "schema": 1}))

    rows = RunStore(storage, RUN).training_rows(3)
    assert [(r.sample_id, r.input_ids) for r in rows] == [
        (i, [1, 2, 3]) for i in ("3-1", "3-2", "3-3", "3-4")]
    honest = sorted(f"{s}-{i}" for s in range(3) for i in range(16)
                    if f"{s}-{i}" in RunStore(storage, RUN).commit(s).sample_ids)
    assert _exported(storage, tmp_path / "m", "messages") == sorted(
        [*honest, "3-0", "3-1", "3-3", "3-4"])
    assert "\\ud800" in (tmp_path / "m" / "data" / "train-00000-of-00001.jsonl").read_text()
    assert _exported(storage, tmp_path / "sf", "specforge") == sorted(
        [*honest, "3-0", "3-1", "3-3", "3-4"])
    # The run's other samples record no token ids: only shard 3's that do have these rows.
    assert _exported(storage, tmp_path / "sp", "speculators") == [
        "3-1#0", "3-2#0", "3-3#0", "3-4#0"]
    assert _exported(storage, tmp_path / "pq", "parquet") == ["3-4"]
    assert foreign_counts()["generated"] >= 2   # the vast part; a part with samples a format
    # lacks (noted once per part)


def test_hidden_commits_with_a_field_more_or_less_read(run: Any, tmp_path: Path) -> None:
    _, storage = _storage(run, tmp_path)
    honest = json.loads(hidden_commit_body(RUN, 2))
    more = json.loads(hidden_commit_body(RUN, 0))
    more["parts"][0]["written_by"] = "a later release"
    less = json.loads(hidden_commit_body(RUN, 1))
    del less["format"]
    for shard, body in ((0, more), (1, less), (2, honest)):
        assert storage.put_once(keys.hidden_commit(RUN, shard), json.dumps(body).encode())
    assert RunStore(storage, RUN).committed("hidden") == {0, 1, 2}
    for shard in range(3):
        index = read_hidden_commit(storage, RUN, shard)
        assert index is not None and index.shard == shard
        assert [(s, t) for p in index.parts for s, t in zip(p.sample_ids, p.turns, strict=True)
                ] == [(f"{shard}-1", 0), (f"{shard}-1", 1)]
        assert index.format == honest["format"]


@pytest.mark.parametrize("metrics", [
    {"step": "inf"}, {"step": "nan"}, {"epoch": "1e999"}, {"step": "3", "lr": "x"},
    {"step": "3", "eta_s": "-inf"}, {"step": "1", "epoch_hours_measured": "nan"},
    {"step": "1", "epoch_hours_measured": "5", "epoch_hours_planned": "x"},
    {"step": "3", "ranks": "x"}, {"step": "3", "ranks": "²"},
])
def test_trainer_metrics_that_are_no_numbers_render(run: Any, tmp_path: Path,
                                                    metrics: dict[str, str]) -> None:
    client, storage = _storage(run, tmp_path)
    config = json.loads(storage.get(keys.run_config(RUN)))
    (Path(storage.root) / keys.run_config(RUN)).write_text(json.dumps({**config,
                                                                       "mode": "online"}))
    before = dict(StatusReader(storage, client, RUN).read())
    client.hset(TRAIN.keys(RUN).metrics, mapping=metrics)
    status = dict(StatusReader(storage, client, RUN).read())
    json.dumps(status, allow_nan=False)   # what status --json prints
    assert f"run {RUN}" in render_status(status)   # type: ignore[arg-type]  # the --json dict
    assert (status["shards"], status["samples"]) == (before["shards"], before["samples"])
    assert Views(storage, client).status(RUN)["run"] == RUN
    assert foreign_counts()["redis"] >= 1


def test_checkpoint_metrics_that_are_no_numbers_report(run: Any, tmp_path: Path) -> None:
    _, storage = _storage(run, tmp_path)
    assert storage.put_once(keys.drafter_checkpoint(RUN, 5, "_COMMIT.json"), dumps({
        "step": 5, "bytes": 10, "schema": 1, "ledger": {"epoch": 0, "done": []},
        "metrics": {"loss": "x", "tau": [1], "tau_step": {"a": 1}, "acceptance_length": 2.5}}))
    assert drafter_history(storage, RUN) == [
        {"step": 5, "loss": None, "tau": None, "tau_step": None, "estimate": 2.5}]
    assert foreign_counts() == {"drafter": 3}


def test_an_export_reports_only_the_files_its_exportable_samples_fill(
        run: Any, tmp_path: Path) -> None:
    """Files planned from the commits' ids for samples that prove unexportable are never
    written: the report names the files there are (it used to ask storage for the others)."""
    _, storage = _storage(run, tmp_path)
    part = _part(storage, 3, 90, [{"id": "3-0", "messages": ROLES, "prompt_ids": [1],
                                   "output_ids": [2]}])
    assert storage.put_once(keys.generated_commit(RUN, 3), dumps({
        "run": RUN, "shard": 3, "parts": [part], "sample_ids": ["3-0"],
        "part_of": {"3-0": part}, "stats": {"samples": 1}, "worker": "w", "schema": 1}))
    out = LocalStorage(str(tmp_path / "pq"))
    report = export_dataset(storage, out, ExportOptions(run=RUN, format="parquet",
                                                        shard_rows=10))
    assert report.samples == {"train": 1}   # the run's other samples hold no token ids
    assert report.files == [key for key in report.files if out.exists(key)] != []
    assert len(report.files) == 1 and report.bytes == out.size(report.files[0])
