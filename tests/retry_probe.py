"""A probe task for test_retry_survives_broker_restart, run by a real Celery worker.

``celery -A tests.retry_probe worker -Q probe``: the first delivery waits for the test's go file,
then retries through :func:`workers.retrying.retry_later`; the retried delivery leaves a file.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.queue.celery_app import app
from common.runs.records import ShardTask
from workers.retrying import retry_later

PROBE = "tests.retry_probe"


@app.task(name=PROBE, bind=True, max_retries=None)
def probe(self, markers: str) -> str:  # noqa: ANN001
    folder = Path(markers)
    if self.request.retries == 0:
        (folder / "first").touch()
        deadline = time.monotonic() + 120
        while not (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        retry_later(self, 0, ShardTask("probe", 0))
    (folder / "retried").touch()
    return "retried"
