"""Any prompt dataset as it is: every row layout in JSONL and Parquet, no text dropped silently.

Real files written with pyarrow and ``datasets``; the intake is the code ``enqueue`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.inputs.sources import expand_inputs
from common.runs.intake import Intake
from common.runs.records import RunConfig


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


DOLLY = {"instruction": "Summarize.", "context": "The Nile is 6,650 km long.",
         "response": "It is long.", "category": "summarization"}
ALPACA = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
INSTANCES = {"id": "seed_task_7", "instruction": "What is the relation between the given pairs?",
             "instances": [{"input": "Night : Day :: Right : Left", "output": "opposites"},
                           {"input": "Cat : Kitten :: Dog : Puppy", "output": "young"}],
             "is_classification": False}
SPECFORGE = {"id": "sf-1", "conversations": [{"role": "user", "content": "Hi there"},
                                             {"role": "assistant", "content": "Hello"},
                                             {"role": "user", "content": "Tell a joke"}]}
ULTRACHAT = {"id": 11, "data": ["What is rain?", "Water falling.", "And snow?", "Frozen."]}
SYSTEM_BESIDE = {"id": "m-1", "system": "Answer in one word.",
                 "messages": [{"role": "user", "content": "Capital of Peru?"}]}

# Expected (id, turns) per conversation; id None: the content hash ("h-...").
CASES: list[tuple[dict[str, Any], str, list[tuple[str | None, list[list[dict]]]]]] = [
    (DOLLY, "dolly", [(None, [[user("Summarize.\n\nThe Nile is 6,650 km long.")]])]),
    (ALPACA, "alpaca", [(None, [[user("Translate to French.\n\nGood morning")]])]),
    (INSTANCES, "instances", [
        ("seed_task_7#0", [[user("What is the relation between the given pairs?\n\n"
                                 "Night : Day :: Right : Left")]]),
        ("seed_task_7#1", [[user("What is the relation between the given pairs?\n\n"
                                 "Cat : Kitten :: Dog : Puppy")]])]),
    (SPECFORGE, "sharegpt", [("sf-1", [[user("Hi there")], [user("Tell a joke")]])]),
    (ULTRACHAT, "ultrachat", [("11", [[user("What is rain?")], [user("And snow?")]])]),
    (SYSTEM_BESIDE, "messages", [("m-1", [[system("Answer in one word."),
                                           user("Capital of Peru?")]])]),
]


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    """``rows`` as JSONL, or as Parquet when ``path`` ends so (written by pyarrow)."""
    if path.suffix == ".parquet":
        # Every row gets every column (None where it has none), as real Parquet files do.
        columns = dict.fromkeys(k for row in rows for k in row)
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(inputs: str | list[str], **kw: Any) -> RunConfig:
    return RunConfig(run="t", model="tiny-qwen3", input=inputs, format=kw.pop("format", "auto"),
                     prompt_field=None, shard_size=10, limit=None, **kw)


def intake_rows(cfg: RunConfig) -> tuple[Intake, list]:
    intake = Intake(cfg)
    return intake, list(intake.rows())


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize(("row", "layout", "expected"), CASES,
                         ids=[layout for _, layout, _ in CASES])
def test_every_layout_becomes_the_expected_conversations(tmp_path: Path, suffix: str, row: dict,
                                                         layout: str, expected: list) -> None:
    src = write(tmp_path / f"in{suffix}", [row])
    for fmt in ("auto", layout):
        intake, items = intake_rows(config(src, format=fmt))
        assert [i.error for i in items] == [None] * len(expected)
        assert [i.row["turns"] for i in items] == [turns for _, turns in expected]
        for item, (want, _) in zip(items, expected, strict=True):
            assert item.row["id"].startswith("h-") if want is None else item.row["id"] == want
        assert intake.layout_summary() == {Path(src).name: {layout: 1}}
        assert not intake.unused, intake.unused


def test_an_unused_text_field_is_reported_and_rejected_when_strict(tmp_path: Path) -> None:
    row = {"id": "u1", "question": "Which river is longest?", "passage": "The Nile..."}
    src = write(tmp_path / "in.jsonl", [{"id": "ok", "question": "2+2?"}, row])
    intake, items = intake_rows(config(src))
    assert all(i.error is None for i in items)
    assert intake.unused == {"passage": {"rows": 1, "example": {
        "file": "in.jsonl", "line": 2, "value": "The Nile..."}}}
    intake, items = intake_rows(config(src, strict_fields=True))
    assert [i.error for i in items][0] is None
    assert items[1].where == {"line": 2} and "passage" in items[1].error
    template = config(src, prompt_template="{passage}\n\n{question}")
    _, items = intake_rows(template)
    assert items[1].row["turns"] == [[user("The Nile...\n\nWhich river is longest?")]]
    assert "passage" in items[0].error  # the first row has no passage: rejected, with the reason


def shards(tmp_path: Path, n: int = 3, per: int = 4) -> list[dict[str, Any]]:
    rows = [{"id": i, "instruction": f"Task {i}", "input": f"input {i}"}
            for i in range(n * per)]
    (tmp_path / "ds" / "data").mkdir(parents=True)
    (tmp_path / "ds" / "README.md").write_text("# a dataset card\n")
    for k in range(n):
        write(tmp_path / "ds" / "data" / f"train-{k:05d}-of-{n:05d}.parquet",
              rows[k * per:(k + 1) * per])
    return rows


def test_directories_globs_and_saved_datasets_expand_in_order(tmp_path: Path) -> None:
    import datasets

    rows = shards(tmp_path)
    names = [f"data/train-{k:05d}-of-00003.parquet" for k in range(3)]
    assert [f.name for f in expand_inputs([str(tmp_path / "ds")])] == names
    glob = str(tmp_path / "ds" / "data" / "train-*.parquet")
    assert [f.name for f in expand_inputs([glob])] == [n.split("/")[1] for n in names]
    _, items = intake_rows(config([str(tmp_path / "ds")]))
    assert [i.row["id"] for i in items] == [
        f"data/train-{k // 4:05d}-of-00003/{k}" for k in range(len(rows))]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    _, saved = intake_rows(config(str(tmp_path / "saved")))
    assert [i.row["id"] for i in saved] == [str(r["id"]) for r in rows]
    assert saved[0].row["turns"] == [[user("Task 0\n\ninput 0")]]
