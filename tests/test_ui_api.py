"""The dashboard's JSON API against a live run: real Redis, a Celery worker, moto S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Pipeline, RedisServer, wait_until
from tests.ui_support import running_ui, simulated_worker, write_prompts

pytestmark = pytest.mark.e2e

RATES = ("tokens", "samples_per_s")  # recomputed from the clock at every read


def test_status_equals_cli_and_series_survive_a_redis_restart(
        pipeline: Pipeline, redis_server: RedisServer, model_cache: Path, tmp_path: Path) -> None:
    with simulated_worker(pipeline, model_cache, "--time-scale", "3.0"), \
            running_ui(pipeline.env, tmp_path / "ui.log") as ui:
        pipeline.cli("enqueue", "--input", write_prompts(tmp_path / "in.jsonl", 32), "--run",
                     "live", "--shard-size", "8", check=True)
        seen: list[int] = []

        def grew() -> bool:
            series = ui.json("/api/runs/live/series?live=1")   # uncommitted parts too
            assert series["totals"]["samples"] >= (seen[-1] if seen else 0)
            seen.append(series["totals"]["samples"])
            return len({n for n in seen if 0 < n < 32}) >= 2
        wait_until(grew, 120, "the series to grow twice while the run goes", interval=0.3)
        running = ui.json("/api/runs/live/status")
        assert running["state"] == "running", (seen, running)
        assert running.keys() == pipeline.status("live").keys()

        pipeline.wait_done("live")
        api, cli = ui.json("/api/runs/live/status"), pipeline.status("live")
        assert {k: v for k, v in api.items() if k not in RATES} == \
            {k: v for k, v in cli.items() if k not in RATES}
        assert api["tokens"]["generated"] == cli["tokens"]["generated"] > 0
        assert api["tokens"]["per_s"] > 0 and cli["tokens"]["per_s"] > 0

        series = ui.json("/api/runs/live/series")
        assert series["samples_done"][-1] == series["totals"]["samples"] == 32
        assert series["totals"]["tokens"] == api["tokens"]["generated"]
        assert max(series["tokens_per_s"]) > 0 and list(series["workers"]) == ["gen@" +
                                                                              _host()]
        assert [r["run"] for r in ui.json("/api/runs")["runs"]] == ["live"]
        grid = ui.json("/api/runs/live/shards")["shards"]
        assert [c["state"] for c in grid] == ["committed"] * 4

        redis_server.kill()
        down = ui.json("/api/runs/live/status")
        assert down["redis"]["reachable"] is False and down["samples"]["done"] == 32
        assert ui.json("/api/runs/live/series") == series
        redis_server.start()
        redis_server.client().flushall()  # nothing of the history lives in Redis
        assert ui.json("/api/runs/live/series") == series
    with running_ui(pipeline.env, tmp_path / "ui2.log") as fresh:  # nor in the dashboard
        assert fresh.json("/api/runs/live/series") == series


def _host() -> str:
    import socket

    return socket.gethostname()
