"""The regenerated dataset leaves the pipeline: every export format from a real run.

A real generate worker regenerates MT-Bench rows on the CPU model into moto's S3; exports are
read back with ``datasets``, line by line, and against the pipeline's own training rows.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.runs.trainrows import training_rows
from common.storage import open_storage
from tests.conftest import ROOT, Pipeline, wait_until
from tests.test_generate_e2e import _commits, _committed_samples
from tests.test_hidden_e2e import generated_run

pytestmark = pytest.mark.e2e


def export(pipeline: Pipeline, out: str, fmt: str, *args: str) -> dict:
    """``export-dataset --json`` of run ``ex``; returns its summary."""
    result = pipeline.cli("export-dataset", "--run", "ex", "--out", out, "--format", fmt,
                          "--json", *args, check=True)
    return json.loads(result.stdout)


def accepted(pipeline: Pipeline) -> dict[str, dict]:
    return {s["id"]: s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "ex")
            if s["quality"]["passed"]}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((path / "data").glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_every_format_holds_each_accepted_sample_once_and_a_killed_export_resumes(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """One generated run serves both: the exports' contents, then an export killed midway."""
    import datasets

    generated_run(pipeline, tmp_path, "ex")
    samples = accepted(pipeline)
    commits = _commits(pipeline.env["DFLASH_STORAGE"], "ex")
    assert sorted(samples) == sorted(i for c in commits.values() for i in c["sample_ids"])

    report = export(pipeline, str(tmp_path / "pq"), "parquet", "--shard-rows", "3")
    files = sorted(str(p) for p in (tmp_path / "pq" / "data").glob("train-*.parquet"))
    assert len(files) == len(report["files"]) == -(-len(samples) // 3)
    loaded = datasets.load_dataset("parquet", data_files=files)["train"]
    assert sorted(loaded["id"]) == sorted(samples) and len(set(loaded["id"])) == len(samples)
    for row in loaded:
        turns = samples[row["id"]]["turns"]
        assert row["prompt_ids"] == [t["prompt_ids"] for t in turns]
        assert row["output_ids"] == [t["output_ids"] for t in turns]
        assert row["messages"][1]["reasoning_content"]
    card = (tmp_path / "pq" / "README.md").read_text()
    assert f"samples exported: {len(samples)}" in card and "license:" in card

    export(pipeline, str(tmp_path / "sf"), "specforge")
    export(pipeline, str(tmp_path / "msg"), "messages")
    for path, key in ((tmp_path / "sf", "conversations"), (tmp_path / "msg", "messages")):
        lines = jsonl(path)
        assert sorted(line["id"] for line in lines) == sorted(samples)
        for line in lines:
            got, want = line[key], samples[line["id"]]["messages"]
            assert [m["role"] for m in got] == [m["role"] for m in want] == \
                ["user", "assistant"] * (len(want) // 2)
            assert [m["content"] for m in got] == [m["content"] for m in want]
            assert all(m["reasoning_content"] == w["reasoning_content"]
                       for m, w in zip(got, want, strict=True) if m["role"] == "assistant")

    export(pipeline, str(tmp_path / "spec"), "speculators")
    rows = {(r["sample_id"], r["turn"]): r for r in jsonl(tmp_path / "spec")}
    expected = [row for s in samples.values() for row in training_rows(s)]
    assert len(rows) == len(expected)
    for row in expected:
        got = rows[(row.sample_id, row.turn)]
        assert (got["input_ids"], got["loss_mask"]) == (row.input_ids, row.loss_mask)

    everything = export(pipeline, str(tmp_path / "all"), "messages", "--include-rejected")
    rejected = [line for line in jsonl(tmp_path / "all") if line["rejected"]]
    assert sum(everything["samples"].values()) == len(samples) + len(rejected)
    assert all(line["quality_reasons"] for line in rejected)
    check_killed_export_then_rerun_gives_the_same_files(pipeline)


def check_killed_export_then_rerun_gives_the_same_files(pipeline: Pipeline) -> None:
    """An export killed after two files, run again, writes only the rest: the same files."""
    bucket = pipeline.env["DFLASH_STORAGE"].split("/")[2]
    whole, cut = f"s3://{bucket}/whole", f"s3://{bucket}/cut"
    export(pipeline, whole, "parquet", "--shard-rows", "1")
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "export-dataset", "--run",
                             "ex", "--out", cut, "--format", "parquet", "--shard-rows", "1"],
                            env={**pipeline.env, "DFLASH_TEST_FAULT": "export.file=sleep:0.5"},
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = open_storage(cut)
    wait_until(lambda: len([k for k in target.list("data/")]) >= 2, 120, "two files exported")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not target.exists("_EXPORT.json"), "the export finished before the kill"

    report = export(pipeline, cut, "parquet", "--shard-rows", "1")
    assert 0 < report["written"] < len(report["files"])
    reference = open_storage(whole)
    names = sorted(target.list(""))
    assert names == sorted(reference.list(""))
    assert all(target.get(k) == reference.get(k) for k in names if k != "_EXPORT.json")
    again = export(pipeline, cut, "parquet", "--shard-rows", "1")
    assert again["written"] == 0 and sorted(target.list("")) == names
