"""Deep nesting with a lone surrogate and NaN bodies, as a role's key may write them, are foreign
objects to every reader: status (text and ``--json``), every dashboard panel, the checkpoint
ledger and the hidden store go on; a panel that fails answers its own error (issue 65)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from safetensors.torch import save as st_save

from common import keys
from common.errors import ForeignObject, HiddenStateError
from common.hidden.store import HiddenPart, _part_records
from common.json_parse import MAX_DEPTH, finite_list, parse
from common.monitor.run_monitor import rebuild
from common.queue import redis_keys
from common.reads import foreign_counts, forget_foreign
from common.runs.checkpoints import Ledger, load_checkpoint, read_ledger, save_checkpoint
from common.runs.records import dumps
from common.runs.schema import CHECKPOINT_SCHEMA
from common.storage import LocalStorage
from producer.commands import render_status
from producer.status import StatusReader
from producer.ui.server import make_app
from producer.ui.views import Views
from tests import test_run_summary
from tests.test_run_summary import GATES, RUN

run = test_run_summary.run  # a run of 6 shards, 3 committed, written once for this module

SURROGATE = b'"s":"\\ud800"'   # orjson refuses it: the standard parser's path
DEEP = b"{" + SURROGATE + b',"reason":"r","a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
NAN = b"{" + SURROGATE + b',"reason":"r","at":NaN,"step":1,"samples":NaN}'
HOSTILE = {"deep": DEEP, "nan": NAN}
PANELS = ("status", "series", "shards", "engines", "gates")


def _storage(base: Path, tmp_path: Path) -> LocalStorage:
    shutil.copytree(base / "storage", tmp_path / "s")
    return LocalStorage(str(tmp_path / "s"))


def _status(storage: LocalStorage, client: Any) -> dict[str, Any]:
    """Status as ``status --json`` prints it (valid JSON: no NaN) and as text."""
    status = dict(StatusReader(storage, client, RUN).read())
    json.dumps(status, allow_nan=False)
    assert render_status(status)   # type: ignore[arg-type]  # the --json dict as RunStatus
    return status


@pytest.mark.parametrize("text", [b"[]", b'{"a": [1, 2.5, {"b": "[[[{\\"}"}], "c": null}',
                                  '{"é": "\\u00e9 \\\\ [", "n": -0.0, "t": true}',
                                  b'{"s": "\\ud800", "x": [1e300, {"y": ["]"]}]}'])
def test_valid_json_reads_as_the_standard_parser_reads_it(text: bytes | str) -> None:
    assert parse("k", text) == json.loads(text)


def test_the_parse_refuses_depth_nan_and_infinity_as_foreign() -> None:
    nested = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse("k", nested) == json.loads(nested)   # at the limit: read
    inner = b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)
    assert parse("k", b'["\\ud800",' + inner + b"]")[0] == "\ud800"
    refused = {"deeper": b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
               "deeper, surrogate": b'["\\ud800",' + b"[" * MAX_DEPTH + b"]" * (MAX_DEPTH + 1),
               "50,000 deep": DEEP, "unclosed": b'["\\ud800",' + b"[" * 50_000,
               "NaN": NAN, "Infinity": b'["\\ud800", Infinity]',
               "-Infinity": b'["\\ud800", -Infinity]', "overflow": b'["\\ud800", 1e400]',
               "plain NaN": b"[NaN]", "not JSON": b'["\\ud800", nope]'}
    for name, text in refused.items():
        with pytest.raises(ForeignObject) as caught:
            parse(f"key {name}", text)
        assert caught.value.key == f"key {name}"
    assert json.loads(finite_list([0.51234, math.nan, math.inf])) == [0.5123, None, None]


def test_hostile_commits_and_pause_records_leave_status_and_the_gates(run, tmp_path) -> None:
    client, base = run
    storage = _storage(base, tmp_path)
    forget_foreign()
    client.flushall()
    before = _status(storage, client)
    for shard, body in zip((4, 5), HOSTILE.values(), strict=True):   # uncommitted shards
        assert storage.put_once(keys.generated_commit(RUN, shard), body)
    for n, body in enumerate(HOSTILE.values()):
        assert storage.put_once(keys.gate_event(RUN, "pause", f"99991231T000000.00000{n}-x"),
                                body)
    after = _status(storage, client)
    assert after["shards"]["committed"] == before["shards"]["committed"] == 3
    assert after["samples"]["done"] == before["samples"]["done"]
    # A pause record that does not read is still a pause: a gate fails closed (issue 65).
    assert before["state"] != "paused" and after["state"] == "paused"
    assert after["pause"]["reason"].startswith("unreadable pause record")
    assert foreign_counts() == {"generated": 2, "gates": 2}
    rebuild(client, storage, RUN, GATES)   # the monitor rebuilt from the same storage
    assert _status(storage, client)["shards"]["committed"] == 3


def test_hostile_redis_values_are_foreign_and_a_pause_fails_closed(run, tmp_path) -> None:
    client, base = run
    storage = _storage(base, tmp_path)
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    for name, body in HOSTILE.items():
        forget_foreign()
        client.lpush(redis_keys.RunKeys(RUN).pauses, body)
        client.hset(redis_keys.redis_engines(), mapping={"bad:gpu0": body,
                                                         "good:gpu0": '{"url": "http://x"}'})
        client.hset(redis_keys.RunKeys(RUN).mtp, "w1", body)
        client.lpush(redis_keys.RunKeys(RUN).gate_examples("too_few_tokens"), body)
        status = _status(storage, client)
        assert status["state"] == "paused", name
        assert status["pause"]["reason"].startswith("unreadable pause record"), name
        assert status["engines"] == {"good:gpu0": {"url": "http://x"}}
        assert status["mtp"] == {}
        assert foreign_counts()["redis"] >= 3


def test_every_panel_answers_with_hostile_objects_planted(run, tmp_path) -> None:
    client, base = run
    storage = _storage(base, tmp_path)
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    assert storage.put_once(keys.generated_commit(RUN, 5), DEEP)
    assert storage.put_once(keys.gate_event(RUN, "pause", "99991231T000000.000000-x"), NAN)
    assert storage.put_once(keys.drafter_checkpoint(RUN, 3, "_COMMIT.json"), DEEP)
    client.lpush(redis_keys.RunKeys(RUN).gate_examples("too_few_tokens"), DEEP)
    client.hset(redis_keys.redis_engines(), "bad:gpu0", NAN)
    answers = asyncio.run(_get(Views(storage, client), PANELS))
    for name, (code, body) in answers.items():
        assert code == 200, (name, body)
        parse(f"the {name} panel", body)   # valid JSON: no NaN, no Infinity
    assert json.loads(answers["status"][1])["shards"]["committed"] == 3


class Failing:
    """Views whose status panel raises what no reader expected; the other panels answer."""

    def status(self, run: str) -> dict[str, Any]:
        raise RecursionError("maximum recursion depth exceeded")

    def series(self, run: str, live: bool = False) -> dict[str, Any]:
        return {"run": run}


def test_a_failing_panel_answers_its_own_error() -> None:
    # type: ignore below: a stand-in Views whose panels raise
    answers = asyncio.run(_get(Failing(), ("status", "series")))   # type: ignore[arg-type]
    code, body = answers["status"]
    assert code == 500
    assert json.loads(body) == {"panel": "status",
                                "error": "RecursionError: maximum recursion depth exceeded"}
    assert answers["series"] == (200, '{"run": "r"}')


async def _get(views: Views, panels: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    run = RUN if isinstance(views, Views) else "r"
    async with TestClient(TestServer(make_app(views))) as client:
        out = {}
        for name in panels:
            response = await client.get(f"/api/runs/{run}/{name}")
            out[name] = (response.status, await response.text())
        return out


def test_a_hostile_checkpoint_commit_is_skipped_by_the_ledger(tmp_path) -> None:
    storage = LocalStorage(str(tmp_path))
    forget_foreign()
    save_checkpoint(storage, RUN, 1, {"step": 1}, Ledger(epoch=2, done=[0]), {})
    for step, body in zip((2, 3), HOSTILE.values(), strict=True):
        assert storage.put_once(keys.drafter_checkpoint(RUN, step, "_COMMIT.json"), body)
    assert read_ledger(storage, RUN) == Ledger(epoch=2, done=[0])
    assert foreign_counts() == {"drafter": 2}


def test_a_checkpoint_of_no_stated_size_is_never_read(tmp_path) -> None:
    storage = LocalStorage(str(tmp_path))
    save_checkpoint(storage, RUN, 1, {"step": 1}, Ledger(epoch=1), {})
    buffer = io.BytesIO()
    torch.save({"step": 2, "ledger": Ledger(epoch=9).to_json()}, buffer)
    for step, size in ((2, 0), (3, None)):
        storage.put_once(keys.drafter_checkpoint(RUN, step, "state.pt"), buffer.getvalue())
        commit = {"run": RUN, "step": step, "seq": 0, "ledger": Ledger(epoch=9).to_json(),
                  "schema": CHECKPOINT_SCHEMA, **({} if size is None else {"bytes": size})}
        storage.put_once(keys.drafter_checkpoint(RUN, step, "_COMMIT.json"), dumps(commit))
    loaded = load_checkpoint(storage, RUN)
    assert loaded is not None and loaded[0]["step"] == 1 and loaded[1].epoch == 1


def _hidden_part(storage: LocalStorage, n: int, data: bytes) -> HiddenPart:
    key = keys.hidden_part(RUN, 0, n)
    storage.put_once(key, data)
    return HiddenPart(key, ["a"], [0], [1], len(data))


def test_a_hidden_part_that_is_not_one_is_a_hidden_state_error(tmp_path) -> None:
    storage = LocalStorage(str(tmp_path))
    header = b'{"__metadata__":{"x":"\\ud800"},"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    no_offsets = st_save({"input_ids": torch.zeros(1, dtype=torch.int32)},
                         metadata={"sample_ids": '["a"]', "turns": "[0]"})
    deep_ids = st_save({"offsets": torch.tensor([0, 1])},
                       metadata={"sample_ids": '["\\ud800",' + "[" * 200 + "]" * 201,
                                 "turns": "[0]"})
    bodies = [len(header).to_bytes(8, "little") + header, no_offsets, deep_ids]
    for n, data in enumerate(bodies):
        with pytest.raises(HiddenStateError, match="not a hidden-state part"):
            list(_part_records(storage, 0, _hidden_part(storage, n, data)))
