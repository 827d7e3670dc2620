"""Epochs end to end: an online run enqueued with --epochs 3 and no --total-steps trains every
training row 3 times, through kill -9 of the trainer at an epoch boundary and mid-epoch; its
last step is the schedule's last and no step ran at learning rate 0."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path

import pytest

from common.runs.checkpoints import committed_steps, load_checkpoint, metrics_history, read_ledger
from common.storage import open_storage
from tests.conftest import Pipeline, TinyTarget, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import adam_steps, start_train_worker

pytestmark = pytest.mark.e2e

ROWS_PER_STEP = 4


def test_three_epochs_survive_kill9_at_a_boundary_and_mid_epoch(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    pipeline.env["DFLASH_MODEL"] = target_model.name
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    # The first trainer kills itself at the end of epoch 1, after that epoch's checkpoint.
    first = start_train_worker(pipeline, "trainer1", DFLASH_TEST_FAULT="train.epoch_end=kill")
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "ep", "--shard-size", "4", "--mode",
                 "online", "--epochs", "3", "--max-new-tokens", "64", "--heldout-min", "1",
                 check=True)
    wait_until(lambda: first.poll() is not None, 300, "the trainer's kill at the epoch boundary")
    boundary = read_ledger(storage, "ep")
    assert (boundary.epoch, boundary.done, len(boundary.tau_by_epoch)) == (1, [], 1)
    per_epoch = sum(boundary.shard_steps.values())
    assert boundary.shard_steps == {s: math.ceil(n / ROWS_PER_STEP)
                                    for s, n in boundary.shard_rows.items()}
    assert boundary.total_steps == 3 * per_epoch        # exact once every shard trained once

    # Nobody queues epoch 2 but the reconciler, from storage; then a kill -9 mid-epoch.
    second = start_train_worker(pipeline, "trainer2")
    wait_until(lambda: committed_steps(storage, "ep")[-1] > per_epoch + 1, 300,
               "a checkpoint inside epoch 2")
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    assert not read_ledger(storage, "ep").finished, "training ended before the kill"

    start_train_worker(pipeline, "trainer3")
    wait_until(lambda: read_ledger(storage, "ep").finished, 300, "the third epoch's end")
    ledger = read_ledger(storage, "ep")
    final = committed_steps(storage, "ep")[-1]
    state, _ = load_checkpoint(storage, "ep", final)
    # Every row 3 times and no more: the steps are exactly 3 epochs' worth, and AdamW's.
    assert final == state["steps"] == 3 * per_epoch == state["schedule"]["total"]
    assert adam_steps(state) == {final} and ledger.finished == "schedule"
    assert ledger.epoch == 2 and len(ledger.tau_by_epoch) == 3
    assert all(t is not None and t >= 1.0 for t in ledger.tau_by_epoch)

    # Every step the trainers logged ran at a learning rate above 0, the last one included.
    logged = {}
    for name in ("trainer1", "trainer2", "trainer3"):
        text = (pipeline.log_dir / f"{name}.log").read_text()
        for step, lr in re.findall(r"step (\d+) loss \S+ .*? lr (\S+) ", text):
            logged[int(step)] = float(lr)
    assert set(logged) == set(range(1, final + 1))
    assert min(logged.values()) > 0
    assert all(float(m["lr"]) > 0 for m in metrics_history(storage, "ep") if m.get("lr"))

    train = pipeline.status("ep")["downstream"]["train"]
    assert (train["epoch"], train["epochs"], train["step"], train["total_steps"]) == \
        (3, 3, final, final)
    assert train["lr"] > 0 and train["tau_by_epoch"] == ledger.tau_by_epoch
