"""Reads of JSONL objects bounded by what an honest one holds, streamed: a 4M-row part of a few
KiB (issue 65, point 3) costs its readers little memory and is foreign; honest parts read on."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from aiohttp.test_utils import TestClient, TestServer

from common import keys
from common.choices import RowKind
from common.config import ReadSettings
from common.errors import ForeignObject
from common.reads import decode_rows, forget_foreign, stream_rows
from common.row_caps import RowCaps, row_caps
from common.runs.records import RunConfig, dumps, encode_jsonl_zst
from common.runs.schemas import SAMPLE
from common.storage import open_storage
from producer.ui.server import make_app
from producer.ui.views import Views
from tests.conftest import RedisServer

RUN = "bounded"
REPO = Path(__file__).resolve().parent.parent
BOMB_ROWS = 4_000_000
RSS_OVER_MIB = 400   # issue 65: reader RSS < 400 MiB over its baseline for the 4M-row part


def _sample(i: int) -> dict:
    return {"id": str(i), "usage": {"completion_tokens": 10},
            "quality": {"passed": True, "reasons": [], "judged_at": 1000.0 + i},
            "written": {"worker": "w1", "at": 1000.0 + i, "wall_s": 1.0}}


def _bomb() -> bytes:
    """``{"id":"x"}`` on 4M lines: ~4 KiB of zstd, ~44 MB decoded, a sample row each."""
    return zstandard.ZstdCompressor(level=19).compress(b'{"id":"x"}\n' * BOMB_ROWS)


def _zst(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)


@pytest.fixture
def planted(s3_storage: str) -> tuple[str, str, str]:
    """A run of 8-row shards with an honest uncommitted part and the bomb as another."""
    storage = open_storage(s3_storage)
    config = RunConfig(run=RUN, model="m", input="x", shard_size=8, max_turns=1)
    storage.put_once(keys.run_config(RUN), dumps(config.to_json()))
    honest = keys.generated_part(RUN, 0, 0)
    storage.put_once(honest, encode_jsonl_zst([_sample(i) for i in range(8)]))
    bomb = keys.generated_part(RUN, 1, 7)
    data = _bomb()
    assert len(data) < 8 * 1024
    storage.put_once(bomb, data)
    return s3_storage, honest, bomb


def _probe(root: str, key: str, mode: str) -> dict:
    """Run one reader in a fresh process; its peak RSS over its baseline comes back."""
    done = subprocess.run([sys.executable, "-m", "tests.bounded_rows_probe", root, RUN, key, mode],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["capped", "default"])
def test_the_4m_row_part_is_foreign_with_bounded_memory(planted: tuple[str, str, str],
                                                       mode: str) -> None:
    root, honest, bomb = planted
    out = _probe(root, bomb, mode)
    assert out["over_mib"] < RSS_OVER_MIB, out
    assert out["rows"] is None and out["foreign"] == {"generated": 1}, out
    good = _probe(root, honest, mode)
    assert good["rows"] == 8 and good["foreign"] == {}, good


def test_the_live_series_leaves_the_bomb_out_with_bounded_memory(
        planted: tuple[str, str, str]) -> None:
    out = _probe(*planted[::2], "series")
    assert out["over_mib"] < RSS_OVER_MIB, out
    assert out["totals"]["samples"] == 8 and out["totals"]["tokens"] == 80, out
    assert out["foreign"] == {"generated": 1}, out


def test_caps_come_from_the_runs_settings() -> None:
    limits = ReadSettings(part_rows=1000, row_bytes=2**20)
    config = RunConfig(run=RUN, model="m", input="x", shard_size=8, max_turns=2)
    assert row_caps(RowKind.INPUT, None, limits) == RowCaps(1000, 2**20, 1000 * (2**20 + 1))
    assert row_caps(RowKind.INPUT, config, limits).rows == 8
    samples = row_caps(RowKind.SAMPLES, config, ReadSettings())
    assert samples.rows == 8 and samples.line_bytes < ReadSettings().row_bytes
    assert samples.decoded_bytes == 8 * (samples.line_bytes + 1)


@pytest.mark.parametrize(("raw", "why"), [
    (b"\n" * 20, "more than 8 lines"),                        # blank lines count too
    (b'{"id":"a"}\n' * 9, "more than 8 lines"),
    (b'{"id":"' + b"x" * 200 + b'"}\n', "a line longer than 100 bytes"),
    (b'{"id":"a"}\n' + b" " * 300, "a line longer than 100 bytes"),   # a last line unended
])
def test_a_cap_passed_makes_the_object_foreign(raw: bytes, why: str) -> None:
    with pytest.raises(ForeignObject, match=why):
        list(stream_rows("k", _zst(raw), SAMPLE, RowCaps(8, 100, 10_000)))


def test_a_frame_short_of_its_stated_size_is_foreign() -> None:
    data = _zst(b'{"id":"a"}\n' * 50_000)
    with pytest.raises(ForeignObject, match="truncated|corrupt"):
        list(stream_rows("k", data[: len(data) // 2], SAMPLE, RowCaps(10**6, 100, 10**7)))


def test_honest_rows_stream_across_chunks(tmp_path: Path) -> None:
    forget_foreign()
    rows = [{"id": str(i), "messages": [{"content": "y" * 5000}]} for i in range(600)]
    data = encode_jsonl_zst(rows)   # ~3 MB decoded: lines cut across 1 MiB chunks
    got = decode_rows(open_storage(str(tmp_path)), "k", data, SAMPLE, 600)
    assert got == rows
    with pytest.raises(ForeignObject, match="more than 599 lines"):
        decode_rows(open_storage(str(tmp_path)), "k", data, SAMPLE, 599)


def test_the_dashboard_reads_live_parts_only_when_asked(tmp_path: Path,
                                                         redis_server: RedisServer) -> None:
    storage = open_storage(str(tmp_path))
    config = RunConfig(run=RUN, model="m", input="x", shard_size=8)
    storage.put_once(keys.run_config(RUN), dumps(config.to_json()))
    storage.put_once(keys.generated_part(RUN, 0, 0),
                     encode_jsonl_zst([_sample(i) for i in range(8)]))

    async def samples(views: Views) -> list[tuple[int, int]]:
        async with TestClient(TestServer(make_app(views))) as client:
            out = []
            for query in ("", "?live=1", "?live=0", "?live=1"):
                response = await client.get(f"/api/runs/{RUN}/series{query}")
                out.append((response.status, (await response.json())["totals"]["samples"]))
            return out

    assert asyncio.run(samples(Views(storage, redis_server.client()))) == \
        [(200, 0), (200, 8), (200, 0), (200, 8)]
