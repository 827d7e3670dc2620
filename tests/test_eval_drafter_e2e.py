"""eval-drafter beside training: a failing eval is recorded, the hybrid target, one error line.

The command on a finished online run (held-out split, exports, refusals) is checked at the end
of tests/test_train_e2e.py, on the run that test trains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common import keys
from common.runs.checkpoints import committed_steps, read_ledger
from common.runs.records import InputManifest
from common.storage import open_storage
from tests.conftest import HYBRID, ROOT, Pipeline, wait_until
from tests.test_generate_e2e import _commits, _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import TRAIN_ENV

pytestmark = pytest.mark.e2e

def test_a_failing_eval_is_recorded_and_training_goes_on(pipeline: Pipeline,
                                                         tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(12))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    pipeline.start_worker("gen")
    trainer = pipeline.start_worker("trainer", kind="train", **{
        **TRAIN_ENV, "DFLASH_TRAIN_EVAL_STEPS": "2", "DFLASH_TEST_FAULT": "eval=eval exploded"})
    pipeline.cli("enqueue", "--input", src, "--run", "bad", "--shard-size", "4", "--mode",
                 "online", "--epochs", "1",
                 "--max-new-tokens", "64", "--heldout-min", "2", check=True)
    pipeline.wait_done("bad")
    wait_until(lambda: len(read_ledger(storage, "bad").done) == 3, 240, "every shard trained")
    steps = committed_steps(storage, "bad")
    assert len(steps) >= 2 and trainer.poll() is None        # checkpoints went on being written
    status = pipeline.status("bad")
    down = status["downstream"]
    assert down["eval_error"]["message"] == "RuntimeError: eval exploded"
    assert down["eval_error"]["step"] >= steps[0] and down["parked"] == 0
    assert down["tau"] is None and not status["parked"]
    log = (pipeline.log_dir / "trainer.log").read_text()
    held = sum(int(n) for n in re.findall(r"rows to train, (\d+) held-out samples left out", log))
    # Every held-out sample the gates accepted is left out, none twice (the batches a busy CPU
    # forms change the sampled replies, so which ones the gates reject varies).
    manifest = InputManifest.from_json(json.loads(storage.get(keys.inputs_manifest("bad"))))
    accepted = {i for c in _commits(pipeline.env["DFLASH_STORAGE"], "bad").values()
                for i in c["sample_ids"]}
    assert len(manifest.heldout) == 2
    assert held == len(manifest.heldout_ids & accepted) >= 1, log[-3000:]
    assert "acceptance-length eval failed; training goes on" in log
    assert "Traceback" in log and "RuntimeError: eval exploded" in log
    text = pipeline.cli("status", "--run", "bad", check=True).stdout
    assert "drafter eval failed at step" in text


def test_eval_drafter_on_a_hybrid_target(pipeline: Pipeline, tmp_path: Path,
                                         model_cache: Path) -> None:
    """The hybrid tiny-qwen3.5: lossless through the command; any failure is one error line."""
    from embedded.tinymodel import ensure_tiny_model
    from workers.train.drafter.export import export_drafter
    from workers.train.drafter.model import DFlashDraftModel, add_mask_token
    from workers.train.drafter.target_loader import load_target

    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    pipeline.cli("enqueue", "--input", src, "--run", "hy", "--model", HYBRID, "--mode",
                 "online", "--epochs", "1", "--heldout-min", "3", check=True)
    run = json.loads(open_storage(pipeline.env["DFLASH_STORAGE"]).get(keys.run_config("hy")))
    assert run["target_layer_ids"] == [4]     # the hybrid default: the layer after full attention
    target, tokenizer = load_target(ensure_tiny_model(model_cache, HYBRID))
    drafter = DFlashDraftModel.for_target(target, add_mask_token(tokenizer, target),
                                          layer_ids=run["target_layer_ids"], init_seed=1)
    export = export_drafter(drafter, tmp_path / "drafter")
    out = json.loads(pipeline.cli("eval-drafter", "--run", "hy", "--drafter", str(export),
                                  "--max-new-tokens", "40", "--block-size", "4", "--json",
                                  check=True).stdout)
    assert out["lossless"] == {"checked": 3, "mismatches": []} and out["tokens"] > 3 * 20

    failed = subprocess.run(
        [sys.executable, "-m", "producer.cli", "eval-drafter", "--run", "hy", "--drafter",
         str(export), "--num", "1"], env={**pipeline.env, "DFLASH_TEST_FAULT": "eval=kernel "
                                          "exploded"}, capture_output=True, text=True, cwd=ROOT,
        timeout=300)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: evaluating the drafter of run 'hy' failed: RuntimeError: kernel "
                      "exploded"], failed.stderr
