"""A retry published while the broker is down waits for it instead of dropping the shard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from celery import Celery

from tests.conftest import ROOT, RedisServer, wait_until
from tests.retry_probe import PROBE


def test_retry_survives_broker_restart(redis_server: RedisServer, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    log = tmp_path / "worker.log"
    env = {**os.environ, "DFLASH_BROKER_URL": redis_server.url}
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.retry_probe", "worker", "-Q", "probe",
             "-P", "threads", "-c", "1", "-n", "probe@%h", "-l", "INFO", "--without-gossip",
             "--without-mingle"], env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: b" ready." in log.read_bytes() or worker.poll() is not None, 120,
                   "the probe worker")
        client = Celery(broker=redis_server.url)
        client.send_task(PROBE, args=[str(markers)], queue="probe")
        wait_until(lambda: (markers / "first").exists(), 60, "the first delivery")
        redis_server.kill()
        (markers / "go").touch()
        wait_until(lambda: b"broker unreachable, retry not published" in log.read_bytes(), 60,
                   "the retry to find the broker down")
        redis_server.start()
        wait_until(lambda: (markers / "retried").exists(), 120, "the retried delivery")
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert b"reject requeue=False" not in log.read_bytes()  # Celery's drop of a delivery
