"""The gate panels' storage reader agrees with the live run monitor (real Redis, local storage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import keys
from common.gates.judge import GateConfig
from common.monitor.run_monitor import resume_gates
from common.queue import redis_keys
from common.runs.records import encode_jsonl_zst
from common.storage import LocalStorage
from producer.ui.gate_source import GateSource, stored_gates
from tests.conftest import RedisServer
from tests.test_monitor import sample
from workers.generate.monitor import RunMonitor


def _live(client: Any, run: str) -> dict[str, Any]:
    """What the dashboard shows from Redis: histogram, examples per reason, window."""
    hist = {int(k): int(v) for k, v in client.hgetall(redis_keys.RunKeys(run).gate_hist).items()}
    reasons = [k.split(":", 1)[1] for k in client.hgetall(redis_keys.RunKeys(run).gates)
               if k.startswith("reason:")]
    examples = {r: [json.loads(x)["id"] for x in
                    client.lrange(redis_keys.RunKeys(run).gate_examples(r), 0, 2)] for r in reasons}
    window = [int(x) for x in client.lrange(redis_keys.RunKeys(run).gate_window, 0, -1)]
    return {"hist": hist, "examples": examples, "window": (len(window), sum(window))}


def _stored(storage: LocalStorage, run: str, gates: GateConfig) -> dict[str, Any]:
    got = stored_gates(storage, run, gates)
    return {"hist": dict(got.histogram),
            "examples": {r: [e["id"] for e in shown] for r, shown in got.examples.items()},
            "window": (got.window["size"], got.window["rejected"]) if got.window else (0, 0)}


def test_stored_gate_figures_equal_the_live_monitor_across_an_accepted_pause(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        client, storage = server.client(), LocalStorage(str(tmp_path / "storage"))
        gates = GateConfig(pause_after=40)
        monitor = RunMonitor(client, storage, "g", gates)
        monitor.ensure_ready()
        source = GateSource(storage, "g")
        judged_at, i, paused, windows = 1_000.0, 0, False, []
        for part in range(12):
            for shard in range(2):  # two shards written in turn, as two workers would
                batch = []
                for _ in range(6):
                    bad = i % 3 == 0 if part < 6 else i % 9 == 0   # a bad stretch, then better
                    batch.append(sample(i, not bad, 6 if bad else 100 + i % 5))
                    i += 1
                judged_at += 1.0
                for s in batch:
                    s["quality"]["judged_at"] = judged_at
                accepted = [s for s in batch if s["quality"]["passed"]]
                rejected = [s for s in batch if not s["quality"]["passed"]]
                storage.put_once(keys.generated_part("g", shard, part),
                                 encode_jsonl_zst(accepted))
                storage.put_once(keys.rejected_part("g", shard, part), encode_jsonl_zst(rejected))
                pause = monitor.record(accepted, rejected)
                live = _live(client, "g")
                assert _stored(storage, "g", gates) == live, (part, shard)
                windows.append(live["window"][0])
                if pause is not None and not paused:
                    paused = True
                    resume_gates(client, storage, "g", gates, accept=True)
                    windows.clear()
            if part == 3:
                first = source.read(gates)
                assert source.read(gates) is first        # no new part: not read again
        # The window restarts at the acceptance and fills up again, as the monitor's does.
        assert paused and windows[0] == 6 and windows[-1] == 40
        assert source.read(gates) is not first and _stored(storage, "g", gates)["hist"] == \
            dict(source.read(gates).histogram) == live["hist"]
    finally:
        server.kill()
