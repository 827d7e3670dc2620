"""Tests for common.inputs.readers (files, S3, streaming) and .rows (formats, reasons, ids)."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from common.errors import BadRow, ConfigError, InputError
from common.inputs.layouts import normalize_row
from common.inputs.readers import RawRecord, iter_records, split_lines
from common.inputs.rows import Conversation, IdRegistry

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "a"}


def user(text: object) -> dict:
    """Build a normalized user message."""
    return {"role": "user", "content": text}


def system(text: str) -> dict:
    """Build a normalized system message."""
    return {"role": "system", "content": text}


def first(data: object, fmt: str = "auto", prompt_field: str | None = None) -> Conversation:
    """A row's first conversation, as the readers take it from :func:`normalize_row`."""
    return normalize_row(data, fmt, prompt_field).conversations[0]


def lines_blob(rows: list) -> bytes:
    """Encode rows as JSONL bytes."""
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def test_jsonl_bad_lines_blank_lines_and_numbering(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\n'
        b"\n   \r\n"
        b'{"prompt": "b\xff"}\n'
        b'{"prompt": \n'
        b"[1, 2]\r\n"
        b'{"prompt": "\xc3\xa9"}'
    )
    records = list(iter_records(str(path)))
    assert [r.line for r in records] == [1, 4, 5, 6, 7]
    assert records[0] == RawRecord(1, {"prompt": "a"}, None)
    assert records[1].data is None and records[1].error == "invalid UTF-8 at byte 13"
    assert records[2].error.startswith("invalid JSON: Expecting value")
    assert records[3].data == [1, 2]
    assert records[4].data == {"prompt": "é"}


def test_compressed_jsonl(tmp_path):
    rows = [{"prompt": f"p{i}"} for i in range(5)]
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines_blob(rows)))
    (tmp_path / "a.ndjson.gz").write_bytes(gzip.compress(lines_blob(rows)))
    for name in ("a.jsonl.zst", "a.ndjson.gz"):
        assert [r.data for r in iter_records(tmp_path / name)] == rows
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(lines_blob(rows))[:-12])
    with pytest.raises(InputError, match="bad.jsonl.gz"):
        list(iter_records(tmp_path / "bad.jsonl.gz"))


def test_split_lines_keeps_empty_lines_across_chunks():
    assert list(split_lines([b"a\n", b"\nb", b"c\n\n", b"d"])) == [b"a", b"", b"bc", b"", b"d"]
    assert list(split_lines([b"x", b"y", b"z\n"])) == [b"xyz"]


def test_json_array_and_wrapped_object(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"version": 2, "data": rows}))
    for name in ("a.json", "b.json"):  # one line: every element starts on line 1
        records = list(iter_records(tmp_path / name))
        assert [(r.line, r.element, r.data) for r in records] == [(1, 1, rows[0]),
                                                                  (1, 2, rows[1])]
    (tmp_path / "p.json").write_text(json.dumps({"version": 2, "data": rows}, indent=2))
    records = list(iter_records(tmp_path / "p.json"))
    assert [(r.line, r.element) for r in records] == [(4, 1), (7, 2)]
    (tmp_path / "c.json").write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(InputError, match="invalid JSON at line 2 column 13"):
        list(iter_records(tmp_path / "c.json"))
    (tmp_path / "d.json").write_bytes(b'[{"prompt": "\xfe"}]')
    with pytest.raises(InputError, match="invalid UTF-8 at byte 13"):
        list(iter_records(tmp_path / "d.json"))
    (tmp_path / "e.json").write_text('"text"')
    with pytest.raises(InputError, match="top-level JSON array"):
        list(iter_records(tmp_path / "e.json"))


def test_parquet_nested_columns(tmp_path):
    table = pa.table(
        {
            "id": ["x", "y", None],
            "messages": [
                [{"role": "user", "content": "q1"}],
                [{"role": "system", "content": "s"}, {"role": "user", "content": "q2"}],
                [{"role": "user", "content": "q3"}],
            ],
            "meta": [{"k": 1}, {"k": 2}, {"k": 3}],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    records = list(iter_records(tmp_path / "a.parquet"))
    assert [r.line for r in records] == [1, 2, 3]
    assert records[1].data["messages"][0] == {"role": "system", "content": "s"}
    assert records[2].data["meta"] == {"k": 3}
    conv = first(records[2].data)
    assert conv.id.startswith("h-") and conv.source == {"id": None, "meta": {"k": 3}}
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="Parquet"):
        list(iter_records(tmp_path / "bad.parquet"))


def test_input_errors(tmp_path):
    with pytest.raises(InputError, match="input not found"):
        iter_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"supported: .*\.jsonl.*\.parquet"):
        iter_records(tmp_path / "x.csv")


def test_s3_jsonl_and_parquet(tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        for key, value in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="inputs")
        # Blank lines must keep later line numbers exact, and a long line spans chunks.
        blob = b'{"prompt": "a"}\n\n\n{"prompt": "' + b"x" * 3_000_000 + b'"}\n{"bad"\n'
        s3.put_object(Bucket="inputs", Key="d/in.jsonl", Body=blob)
        zst = zstandard.ZstdCompressor().compress(b'\n{"prompt": "z"}\n')
        s3.put_object(Bucket="inputs", Key="d/in.jsonl.zst", Body=zst)
        pq.write_table(pa.table({"prompt": ["p1", "p2"]}), tmp_path / "t.parquet")
        s3.upload_file(str(tmp_path / "t.parquet"), "inputs", "d/t.parquet")
        s3.put_object(Bucket="inputs", Key="d/t.json", Body=b'{"rows": [{"prompt": "j"}]}')

        records = list(iter_records("s3://inputs/d/in.jsonl"))
        assert [r.line for r in records] == [1, 4, 5]
        assert len(records[1].data["prompt"]) == 3_000_000
        assert records[2].error.startswith("invalid JSON")
        records = list(iter_records("s3://inputs/d/in.jsonl.zst", lambda: s3))
        assert [(r.line, r.data) for r in records] == [(2, {"prompt": "z"})]
        records = list(iter_records("s3://inputs/d/t.parquet"))
        assert [(r.line, r.data) for r in records] == [(1, {"prompt": "p1"}), (2, {"prompt": "p2"})]
        assert [r.data for r in iter_records("s3://inputs/d/t.json")] == [{"prompt": "j"}]
        with pytest.raises(InputError, match="input not found: s3://inputs/nope.jsonl"):
            iter_records("s3://inputs/nope.jsonl")
        with pytest.raises(InputError, match="no such bucket"):
            iter_records("s3://nobucket/a.parquet")
    finally:
        server.stop()


def test_jsonl_streams_with_flat_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "y" * 200}]}) + "\n"
    with open(path, "w") as handle:
        for _ in range(200_000):
            handle.write(line)
    tracemalloc.start()
    try:
        count = sum(1 for r in iter_records(str(path)) if r.error is None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 200_000
    assert peak < 50 * 1024 * 1024


@pytest.mark.parametrize(
    ("row", "fmt", "turns"),
    [
        (
            {"messages": [system("s"), U, A, user("u2")]},
            "messages",
            [[system("s"), U], [user("u2")]],
        ),
        (
            {"conversations": [{"from": "human", "value": "h1"}, {"from": "gpt", "value": "g"}]},
            "sharegpt",
            [[user("h1")]],
        ),
        ({"question_id": 81, "turns": ["q1", "q2"]}, "mt_bench", [[user("q1")], [user("q2")]]),
        (
            {"question": "why?", "system": "be brief"},
            "prompt",
            [[system("be brief"), user("why?")]],
        ),
        ({"instruction": "Translate", "input": "hola"}, "prompt", [[user("Translate\n\nhola")]]),
    ],
)
def test_every_format_explicit_and_auto(row, fmt, turns):
    assert first(row, fmt).turns == turns
    assert first(row).turns == turns


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        ("s u a u a", [["s", "u"], ["u"]]),
        ("u u a", [["u", "u"]]),
        ("u a u", [["u"], ["u"]]),
        ("s a u a a u", [["s", "u"], ["u"]]),
        ("u s a u", [["u", "s"], ["u"]]),
        ("s u a s u a", [["s", "u"], ["s", "u"]]),
    ],
)
def test_grouping_rules(roles, expected):
    names = {"s": "system", "u": "user", "a": "assistant"}
    messages = [{"role": names[r], "content": f"{r}{i}"} for i, r in enumerate(roles.split())]
    turns = first({"messages": messages}).turns
    assert [[m["role"][0] for m in group] for group in turns] == expected
    assert all(m["role"] != "assistant" for group in turns for m in group)


@pytest.mark.parametrize(
    ("row", "kwargs", "reason"),
    [
        ([1], {}, "row is a list, expected an object"),
        (None, {}, "row is null, expected an object"),
        ({"foo": 1, "bar": 2}, {}, "found keys: bar, foo"),
        ({"messages": "hi"}, {}, "messages is a string, expected a list of messages"),
        ({"messages": 3}, {}, "messages must be a list, got int"),
        ({"messages": [U, U, user(5)]}, {}, r"messages\[2\].content must be a string, got int"),
        ({"messages": [U, U, U, {"role": "robot"}]}, {}, r"unknown role 'robot' in messages\[3\]"),
        ({"messages": ["hi"]}, {}, r"messages\[0\] must be an object, got str"),
        ({"messages": [{"content": "x"}]}, {}, r"messages\[0\] has no 'role'"),
        ({"messages": [system("s"), user("  \n")]}, {}, r"empty user message at messages\[1\]"),
        ({"messages": [system("s"), A]}, {}, "no user message"),
        ({"messages": []}, {}, "no user message"),
        ({"messages": [U, system("late")]}, {}, "ends with a system message"),
        (
            {"messages": [U, A, system("x")]},
            {},
            "ends with a system",
        ),
        (
            {"conversations": [{"from": "bing", "value": "x"}]},
            {},
            r"unknown role 'bing' in conversations\[0\]",
        ),
        ({"turns": ["q", ""]}, {}, r"empty user message at turns\[1\]"),
        ({"turns": "q"}, {}, "turns is a string, expected a list of turns"),
        ({"id": 1, "data": "q"}, {}, "data is a string, expected a list of turns"),
        ({"prompt": 3}, {}, "prompt must be a string, got int"),
        ({"prompt": " "}, {}, "empty user message in field 'prompt'"),
        ({"prompt": "x"}, {"fmt": "messages"}, "missing field 'messages'"),
        ({"text": "x"}, {"fmt": "prompt", "prompt_field": "body"}, "no prompt field 'body'"),
        ({"id": ["a"], "prompt": "x"}, {}, "id must be a string or integer, got list"),
        ({"id": True, "prompt": "x"}, {}, "id must be a string or integer, got bool"),
        ({"id": "", "prompt": "x"}, {}, "id is an empty string"),
        ({"prompt": "bad \ud800"}, {}, "unpaired UTF-16 surrogate"),
    ],
)
def test_bad_row_reasons(row, kwargs, reason):
    with pytest.raises(BadRow, match=reason):
        normalize_row(row, **kwargs)


def test_unknown_format_is_config_error():
    with pytest.raises(ConfigError, match="unknown input format 'csv'"):
        normalize_row({"prompt": "x"}, "csv")


def test_prompt_field_option_and_source():
    row = {"uid": 7, "body": "hello", "text": "ignored", "output": "long answer", "when": 1e400}
    conv = first(row, "prompt", prompt_field="body")
    assert conv.id == "7" and conv.turns == [[user("hello")]]
    assert conv.source == {"id": 7, "text": "ignored", "when": "inf"}
    assert first(row, prompt_field="body").turns == [[user("hello")]]


def test_ids_preference_stability_and_round_trip():
    assert first({"question_id": 3, "conversation_id": "c", "prompt": "x"}).id == "3"
    assert first({"conversation_id": "c", "uid": 1, "prompt": "x"}).id == "c"
    a = first({"messages": [U, {"role": "assistant", "content": "one"}], "tag": 1})
    b = first({"conversations": [{"from": "user", "value": "hi"}], "tag": 2})
    assert a.id == b.id and a.id.startswith("h-") and len(a.id) == 18
    assert a.id != first({"prompt": "hi!"}).id
    conv = first({"id": "s1", "category": "math", "messages": [U]})
    assert conv.source == {"id": "s1", "category": "math"}
    data = json.loads(json.dumps(conv.to_json()))
    assert Conversation.from_json(data) == conv


def test_duplicate_ids():
    registry = IdRegistry()
    registry.check_and_add("a")
    registry.check_and_add("b")
    with pytest.raises(BadRow, match="duplicate id 'a'"):
        registry.check_and_add("a")
    assert len(registry) == 2
