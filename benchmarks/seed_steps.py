"""One measured step of ``seed_scale.py`` in its own process; prints its figures as JSON.

``seed_steps.py STEP old|new STORAGE BROKER LATENCY_MS OUT``. Requests are counted (and, on S3,
delayed by the latency shim) at the storage client; peak RSS is the process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.seed_run import GATES, RUN  # noqa: E402

REQUESTS = [0]
_LOCK = threading.Lock()


def _count() -> None:
    with _LOCK:
        REQUESTS[0] += 1


def install_counters(latency_ms: float) -> None:
    """Count every storage request; on S3 also sleep ``latency_ms`` before each is sent."""
    import common.storage as storage_module

    make = storage_module.s3_client

    def shimmed():  # noqa: ANN202
        client = make()

        def delay(**_: Any) -> None:
            _count()
            time.sleep(latency_ms / 1000)

        client.meta.events.register("before-send.s3", delay)
        return client

    storage_module.s3_client = shimmed
    local = storage_module.LocalStorage
    for name in ("get", "exists", "size", "put_once", "put_file_once", "replace", "list"):
        original = getattr(local, name)

        def counted(self, *args, _original=original, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            _count()
            return _original(self, *args, **kwargs)

        setattr(local, name, counted)


def timed(label: str, action: Callable[[], Any], reads: list[list[Any]]) -> Any:
    before, started = REQUESTS[0], time.perf_counter()
    result = action()
    reads.append([label, time.perf_counter() - started, REQUESTS[0] - before])
    return result


def run_step(step: str, old: bool, url: str, broker: str, out: Path) -> list[list[Any]]:
    import redis

    from common.storage import LocalStorage, open_storage
    from producer.status import StatusReader

    storage = open_storage(url)
    client = redis.Redis.from_url(broker, decode_responses=True)
    reads: list[list[Any]] = []
    if old:
        from benchmarks import seed_legacy

        seed_legacy.install()
        StatusReader = seed_legacy.LegacyStatusReader  # noqa: N806
    if step in ("status", "status_wiped"):
        reader = StatusReader(storage, client, RUN)
        timed("cold", reader.read, reads)
        if step == "status":
            timed("warm", reader.read, reads)
    elif step == "rebuild":
        from common.monitor.run_monitor import rebuild
        from embedded.reference_monitor import rebuild_from_parts

        timed("", lambda: (rebuild_from_parts if old else rebuild)(client, storage, RUN, GATES),
              reads)
    elif step == "resume":
        from producer.cli import main

        os.environ["DFLASH_STORAGE"] = url
        with contextlib.redirect_stdout(io.StringIO()):  # the second finds everything queued
            for label in ("first", "again"):
                timed(label, lambda: main(["resume", "--run", RUN, "--json"],
                                          standalone_mode=False), reads)
    elif step == "dashboard":
        asyncio.run(_dashboard(storage, client, reads))
    elif step == "report":
        from producer.report import build_report

        timed("", lambda: build_report(storage, RUN), reads)
    elif step == "export":
        from producer.dataset_export import ExportOptions, export_dataset

        timed("", lambda: export_dataset(storage, LocalStorage(str(out)),
                                         ExportOptions(RUN, "parquet")), reads)
    else:
        raise SystemExit(f"error: unknown step {step!r}")
    return reads


async def _dashboard(storage: Any, client: Any, reads: list[list[Any]]) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    import producer.ui.views as views_module
    from producer.ui.server import make_app

    app = make_app(views_module.Views(storage, client))
    async with TestClient(TestServer(app)) as http:
        for panel in ("status", "series"):
            for label in ("cold", "warm"):
                before, started = REQUESTS[0], time.perf_counter()
                response = await http.get(f"/api/runs/{RUN}/{panel}")
                assert response.status == 200, await response.text()
                await response.read()
                reads.append([f"/{panel} {label}", time.perf_counter() - started,
                              REQUESTS[0] - before])


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: per address space, so not the parent's before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    step, path, url, broker, latency, out = sys.argv[1:7]
    install_counters(float(latency))
    reads = run_step(step, path == "old", url, broker, Path(out))
    rss = peak_rss_mib()
    print(json.dumps({"reads": reads, "rss_mib": rss}))


if __name__ == "__main__":
    main()
