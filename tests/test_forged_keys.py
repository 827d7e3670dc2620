"""Objects of no key layout change nothing (issue 53), on a local directory and on moto's S3.

A grant whose ``*`` crosses a ``/`` let one stage's key write ``runs/R/drafter/index/...`` or
``runs/R/generated/shard-N/drafter/_COMMIT.json``; a reader that searched keys for a pattern
took them for a checkpoint and a commit, and a restarted trainer started over. Here those
objects (and a checkpoint of the exact layout whose commit does not read) are planted in a live
online run, its trainer killed: status shows the real step, the restarted trainer goes on from
the real checkpoint and finishes the run (the reconciler queueing its lost shard again), the
shard's commit stands, and export-drafter exports a real checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from common import keys
from common.runs.checkpoints import checkpoints, committed_steps, latest_step, read_ledger
from common.runs.commit_cache import RunListing
from common.runs.store import RunStore
from common.storage import Storage, open_storage
from tests.conftest import Pipeline, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import adam_steps, start_train_worker

pytestmark = pytest.mark.e2e

RUN = "forged"
SHARDS = 4
FORGED_STEP = keys.drafter_prefix(RUN) + "index/step-000999/_COMMIT.json"   # index key's reach
FORGED_COMMIT = keys.generated_shard_prefix(RUN, 1) + "drafter/_COMMIT.json"  # train key's
UNREADABLE = keys.drafter_checkpoint(RUN, 999_999, "_COMMIT.json")  # exact layout, no commit


def plant(storage: Storage) -> dict:
    """The issue's objects, each made to be believed: a ledger that says every shard is done,
    a commit that says shard 1 holds other samples; and a checkpoint commit that does not read."""
    ledger = {"epoch": 0, "done": list(range(SHARDS)), "partial": {}, "finished": ""}
    storage.put_once(FORGED_STEP, json.dumps({"run": RUN, "step": 999, "seq": 0,
                                              "ledger": ledger, "metrics": {}}).encode())
    real = json.loads(storage.get(keys.generated_commit(RUN, 1)))
    forged = {**real, "sample_ids": ["forged-0"], "stats": {**real["stats"], "samples": 1}}
    storage.put_once(FORGED_COMMIT, json.dumps(forged).encode())
    storage.put_once(UNREADABLE, b"{not json")
    return real


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_forged_keys_change_nothing(pipeline: Pipeline, tmp_path: Path, backend: str) -> None:
    if backend == "local":
        pipeline.env["DFLASH_STORAGE"] = str(tmp_path / "storage")
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4 * SHARDS))
    victim = start_train_worker(pipeline, "trainer")
    pipeline.start_worker("gen")   # stays up: its reconciler heals what the kill left
    pipeline.cli("enqueue", "--input", src, "--run", RUN, "--shard-size", "4", "--mode",
                 "online", "--epochs", "1", "--max-new-tokens", "64", "--heldout-min", "2",
                 check=True)
    wait_until(lambda: committed_steps(storage, RUN), 300, "a first drafter checkpoint")
    wait_until(lambda: RunStore(storage, RUN).committed() >= {1}, 300, "shard 1's commit")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    before = latest_step(storage, RUN)
    assert before is not None and len(read_ledger(storage, RUN).done) < SHARDS, \
        "training ended before the kill"
    real_commit = plant(storage)

    # Readers: the real checkpoint and the real commit, the foreign objects ignored.
    assert latest_step(storage, RUN) == before and (999, 0) not in checkpoints(storage, RUN)
    assert RunListing.of(storage, RUN).commits[1] == keys.generated_commit(RUN, 1)
    status = pipeline.status(RUN)
    assert status["downstream"]["committed"] == len(read_ledger(storage, RUN).done) < SHARDS

    heir = start_train_worker(pipeline, "heir")
    wait_until(lambda: sorted(read_ledger(storage, RUN).done) == list(range(SHARDS)), 400,
               "every shard trained by the restarted trainer (no resume: the reconciler)")
    log = (pipeline.log_dir / "heir.log").read_text()
    assert f"resumed the drafter from step {before} " in log and "new drafter" not in log, log
    assert log.count(f"ignoring storage key {FORGED_STEP}") == 1, log   # logged once
    assert f"checkpoint {UNREADABLE.rsplit('/', 1)[0]} skipped" in log, log
    gen_log = (pipeline.log_dir / "gen.log").read_text()
    assert "not reconciled this pass" not in gen_log, gen_log[-3000:]

    final = latest_step(storage, RUN)
    assert final is not None and before < final < 999
    from common.runs.checkpoints import load_checkpoint

    state, ledger = load_checkpoint(storage, RUN)
    assert adam_steps(state) == {final} and sorted(ledger.done) == list(range(SHARDS))
    pipeline.wait_done(RUN)
    status = pipeline.status(RUN)
    assert status["downstream"]["committed"] == SHARDS
    assert final <= int(status["downstream"]["train"]["step"]) < 999
    commits = {s: json.loads(storage.get(keys.generated_commit(RUN, s))) for s in range(SHARDS)}
    assert commits[1] == real_commit and status["shards"]["committed"] == SHARDS
    assert status["samples"]["done"] == sum(len(c["sample_ids"]) + len(c.get("rejected_ids", ()))
                                            for c in commits.values())

    out = tmp_path / "drafter"
    exported = json.loads(pipeline.cli("export-drafter", "--run", RUN, "--out", str(out),
                                       "--json", check=True).stdout)
    assert exported["step"] in committed_steps(storage, RUN) and exported["step"] <= final
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    heir.send_signal(signal.SIGTERM)
    heir.wait(timeout=60)
