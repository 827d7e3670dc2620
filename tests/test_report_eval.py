"""The stored ``eval-drafter --dataset`` table in ``report`` (text, --json's ``eval``, the figure)
and the dashboard's ``/api/runs/<run>/evals``; forged records are skipped with a note."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from common import keys
from common.runs.evals import DEFINITION, newest_eval, write_eval
from common.storage import LocalStorage
from producer.cli import main
from tests.test_report import PNG_MAGIC, RUN, put, write_run


def result() -> dict[str, Any]:
    """What eval-drafter --dataset --engine sglang returns (two sets, two levels)."""
    def level(rate: float, base: float) -> dict[str, Any]:
        return {"tokens": 64, "seconds": 1.0, "tokens_per_s": rate, "spec_accept_length": 3.5,
                "spec_verify_ct": 18, "baseline_tokens_per_s": base,
                "speedup": round(rate / base, 4)}

    def row(tau: float | None) -> dict[str, Any]:
        return {"prompts": 2, "tokens": 64, "tau": tau, "tau_pooled": tau,
                "spec_accept_length": 3.5,
                "by_position": {"0-1k": tau, "1k-4k": None, "4k-16k": None, "16k+": None},
                "lossless": {"checked": 2, "mismatches": []} if tau else None,
                "tokens_per_s": 40.0, "speedup": 2.0,
                "concurrency": {"1": level(40.0, 20.0), "8": level(90.0, 75.0)}}

    return {"run": RUN, "engine": "sglang", "max_new_tokens": 32, "thinking": "off",
            "url": "http://gpu:30000", "baseline_url": "http://gpu:30001", "drafter": None,
            "datasets": {"gsm8k": row(2.75), "mt-bench": row(None)}, "definition": DEFINITION}


def report(storage: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["report", "--run", RUN, "--storage", str(storage), *args])


def dashboard(storage: LocalStorage, path: str) -> tuple[int, dict[str, Any]]:
    """A GET on the dashboard's app (real aiohttp server, real storage; Redis never asked)."""
    import redis
    from aiohttp.test_utils import TestClient, TestServer

    from producer.ui.server import make_app
    from producer.ui.views import Views

    async def get() -> tuple[int, dict[str, Any]]:
        app = make_app(Views(storage, redis.Redis(port=1)))
        async with TestClient(TestServer(app)) as client:
            answer = await client.get(path)
            return answer.status, await answer.json()

    return asyncio.run(get())


def test_a_stored_eval_shows_in_report_and_on_the_dashboard(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    write_run(storage)
    assert report(tmp_path, "--json", "--no-png").exit_code == 0
    assert json.loads(report(tmp_path, "--json", "--no-png").output)["eval"] is None
    key = write_eval(storage, RUN, result(), 400, None)
    parsed = keys.parse(key)
    assert parsed is not None and parsed.kind is keys.KeyKind.EVAL

    out = json.loads(report(tmp_path, "--json", "--no-png").output)
    record = out["eval"]["record"]
    assert out["eval"]["key"] == key and out["eval"]["skipped"] == []
    assert record["drafter"] == {"step": 400, "name": None} and record["engine"] == "sglang"
    assert record["sets"] == ["gsm8k", "mt-bench"] and record["thinking"] == "off"
    assert record["datasets"]["gsm8k"]["tau"] == 2.75
    assert record["datasets"]["gsm8k"]["concurrency"]["8"]["speedup"] == 1.2
    assert record["url"] == "http://gpu:30000"

    text = report(tmp_path, "--no-png").output
    assert "drafter eval" in text and "drafter step 400, engine sglang" in text
    table = text[text.index("drafter eval"):].splitlines()
    assert table[1].split()[:3] == ["set", "prompts", "tokens"]
    assert table[2].split()[:4] == ["gsm8k", "2", "64", "2.750"]
    assert any(line.split()[:5] == ["mt-bench", "8", "90.000", "75.000", "1.200"]
               for line in table)

    png = tmp_path / "report.png"
    assert report(tmp_path, "--png", str(png)).exit_code == 0
    assert png.read_bytes().startswith(PNG_MAGIC)

    status, panel = dashboard(storage, f"/api/runs/{RUN}/evals")
    assert status == 200 and panel["record"] == record and panel["key"] == key
    assert panel["bars"][0] == {"set": "gsm8k", "tau": 2.75, "measure": "tau",
                                "speedup": {"1": 2.0, "8": 1.2}}
    assert panel["bars"][1]["measure"] == "spec_accept_length"
    assert panel["drafter"] == "drafter step 400"
    assert dashboard(storage, "/api/runs/nope/evals")[0] == 404


FORGED = {
    "not JSON": b"{not json",
    "the wrong type": None,          # filled in: the real record with a string for a count
    "deep nesting": b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "NaN": None,
    "another run's": None,
}


def _forged(real: dict[str, Any]) -> dict[str, bytes]:
    wrong = json.loads(json.dumps(real))
    wrong["datasets"]["gsm8k"]["prompts"] = "2"
    nan = json.loads(json.dumps(real))
    nan["datasets"]["gsm8k"]["tau"] = float("nan")
    other = {**json.loads(json.dumps(real)), "run": "other"}
    return {**{k: v for k, v in FORGED.items() if v is not None},
            "the wrong type": json.dumps(wrong).encode(),
            "NaN": json.dumps(nan, allow_nan=True).encode(),
            "another run's": json.dumps(other).encode()}


def test_a_forged_eval_record_is_skipped_with_a_note(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    storage = LocalStorage(str(tmp_path))
    write_run(storage)
    real_key = write_eval(storage, RUN, result(), 7, "/models/Qwen3-8B-DFlash-b16")
    real = json.loads(storage.get(real_key))
    forged = _forged(real)
    for n, body in enumerate(forged.values()):   # newer than the real one: stamps sort after
        put(storage, keys.eval_record(RUN, f"29990101T000000.{n:06d}-ffffff"), body)
    with caplog.at_level(logging.WARNING):
        found = newest_eval(storage, RUN)
    assert found is not None and found["key"] == real_key
    assert len(found["skipped"]) == len(forged)
    assert "ignoring stored object" in caplog.text

    out = json.loads(report(tmp_path, "--json", "--no-png").output)
    assert out["eval"]["record"]["drafter"] == {"step": None, "name": "Qwen3-8B-DFlash-b16"}
    assert len(out["eval"]["skipped"]) == len(forged)
    text = report(tmp_path, "--no-png")
    assert text.exit_code == 0 and text.output.count("skipped:") == len(forged)
    assert "drafter Qwen3-8B-DFlash-b16, engine sglang" in text.output
    status, panel = dashboard(storage, f"/api/runs/{RUN}/evals")
    assert status == 200 and panel["key"] == real_key and len(panel["skipped"]) == len(forged)

    gone = LocalStorage(str(tmp_path / "only-forged"))
    write_run(gone)
    for n, body in enumerate(forged.values()):
        put(gone, keys.eval_record(RUN, f"29990101T000000.{n:06d}-ffffff"), body)
    alone = report(tmp_path / "only-forged", "--no-png")
    assert alone.exit_code == 0 and "no stored record reads" in alone.output
    assert json.loads(report(tmp_path / "only-forged", "--json", "--no-png").output
                      )["eval"]["record"] is None
    assert dashboard(gone, f"/api/runs/{RUN}/evals")[1]["record"] is None
