"""The demo prints the dashboard's URL (beside Flower's) and serves the run there, its
Downstream figures following the trainer while the demo runs."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from producer.demo import free_port
from tests.conftest import ROOT, wait_until
from tests.test_demo import SHORT_TRAIN
from tests.ui_support import write_prompts

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(1800)  # the whole demo, trainer included, on 2 busy cores
def test_demo_starts_the_dashboard_and_prints_its_url(model_cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "PYTHONUNBUFFERED": "1",
           **SHORT_TRAIN, "DFLASH_TRAIN_MIN_SUPERVISED_TOKENS": "8"}  # short answers train too
    port = free_port()
    log = tmp_path / "demo.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "demo", "--no-flower", "--out",
             str(tmp_path / "demo"), "--input", write_prompts(tmp_path / "in.jsonl", 8),
             "--shard-size", "2", "--max-new-tokens", "64", "--ui-port", str(port),
             "--eval-prompts", "2", "--eval-max-new-tokens", "16"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        line = wait_until(lambda: re.search(r"Dashboard: (http://\S+)  \(user (\w+), password "
                                            r"(\S+)\)", log.read_text()), 120,
                          "the demo to print the dashboard URL")
        url, user, password = line.groups()
        assert url == f"http://127.0.0.1:{port}/runs/mt-bench-demo"
        token = base64.b64encode(f"{user}:{password}".encode()).decode()

        def status() -> dict | None:
            request = urllib.request.Request(
                url.replace("/runs/", "/api/runs/") + "/status",
                headers={"Authorization": f"Basic {token}"})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return json.loads(response.read())
            except OSError:
                return None
        assert wait_until(status, 60, "the dashboard to serve the demo run")["run"] == \
            "mt-bench-demo"
        # The Downstream panel's figures: the online run's trainer, live (not "hidden 0 / N").
        def training_shown() -> dict | None:
            assert proc.poll() is None, log.read_text()[-3000:]  # the demo still serving
            shown = status()
            return shown["downstream"] if shown and shown["downstream"]["train"].get(
                "step") else None
        down = wait_until(training_shown, 600, "the dashboard to show a training step")
        assert down["mode"] == "online" and down["stage"] == "train"
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "dflash-pipeline ui" in log.read_text()
