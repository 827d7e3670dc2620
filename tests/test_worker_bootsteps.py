"""A worker's start-up and shut-down are Celery bootsteps (issue 68): the engine is loaded while
the worker is built, shards stop as it begins to stop, and the engine closes after the pool."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery.worker import WorkController

from tests.conftest import ROOT, Pipeline, wait_until


def _boot_order() -> list[str]:
    """The generate worker's steps in the order Celery starts them (it stops them reversed)."""
    from workers.generate.app import app

    blueprint = WorkController.Blueprint(steps=app.steps["worker"])
    blueprint.steps = blueprint.claim_steps()   # as Blueprint.apply does: the last step is found
    return [step.name for step in blueprint._finalize_steps(blueprint.steps)]


def test_the_worker_steps_start_after_the_pool_and_the_engine_closes_with_the_consumer() -> None:
    from workers.generate.app import EngineCloser, EngineStep, app
    from workers.reconciler import ReconcilerStep

    order = _boot_order()
    pool = order.index("celery.worker.components.Pool")
    for step in (EngineStep, ReconcilerStep):
        assert pool < order.index(step.name) < order.index("celery.worker.components.Consumer")
    assert order[-1] == "celery.worker.components.Consumer"
    # Consumer steps are shut down after every worker step stopped (the pool's last task done).
    assert EngineCloser in app.steps["consumer"] and hasattr(EngineCloser, "shutdown")


@pytest.mark.e2e
def test_a_worker_whose_engine_fails_to_start_exits_with_the_line(pipeline: Pipeline) -> None:
    log = pipeline.log_dir / "broken.log"
    failing = f"{sys.executable} -c 'raise SystemExit(3)' {{port}}"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate", "--name", "broken@%h",
             "--engine", "sglang", "--engine-cmd", failing],
            env=pipeline.env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    pipeline.workers.append(proc)   # stopped with the others if it did start
    wait_until(lambda: proc.poll() is not None or b" ready." in log.read_bytes(), 180,
               "the worker to exit or say ready")
    text = log.read_text()
    assert proc.poll() not in (None, 0), text[-3000:]
    assert "engine failed to start" in text and " ready." not in text, text[-3000:]
