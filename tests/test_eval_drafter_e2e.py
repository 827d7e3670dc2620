"""eval-drafter on a finished online run: held-out split, tau in checkpoints and status, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common import keys
from common.drafter_store import committed_steps, read_ledger
from common.records import InputManifest
from common.storage import open_storage
from tests.conftest import HYBRID, MT_BENCH, ROOT, Pipeline, wait_until
from tests.test_generate_e2e import _commits, _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import TRAIN_ENV

pytestmark = pytest.mark.e2e

FIELDS = {"tau", "tau_pooled", "accepted_hist", "per_position", "prompts", "tokens"}


def test_eval_drafter_on_a_finished_online_run(pipeline: Pipeline, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    result = pipeline.cli("eval-drafter", "--run", "ev")
    assert result.returncode == 1 and "not found" in result.stderr, result.stderr

    pipeline.start_worker("gen")
    pipeline.start_worker("trainer", kind="train",
                          **{**TRAIN_ENV, "DFLASH_TRAIN_EVAL_STEPS": "3"})
    pipeline.cli("enqueue", "--input", src, "--run", "ev", "--shard-size", "8", "--mode",
                 "online", "--max-new-tokens", "96", "--heldout-min", "3", check=True)
    manifest = InputManifest.from_json(json.loads(storage.get(keys.inputs_manifest("ev"))))
    assert len(manifest.heldout) == 3
    pipeline.wait_done("ev")
    wait_until(lambda: sorted(read_ledger(storage, "ev").done) == [0, 1], 240,
               "both shards trained")

    log = (pipeline.log_dir / "trainer.log").read_text()
    held = sum(int(n) for n in re.findall(r"rows to train, (\d+) held-out samples left out", log))
    # Every held-out sample the gates accepted is left out, none twice (the batches a busy CPU
    # forms change the sampled replies, so which ones the gates reject varies).
    accepted = {i for c in _commits(pipeline.env["DFLASH_STORAGE"], "ev").values()
                for i in c["sample_ids"]}
    assert held == len(manifest.heldout_ids & accepted) >= 1, log[-3000:]
    assert "acceptance length tau" in log
    final = committed_steps(storage, "ev")[-1]
    commit = json.loads(storage.get(keys.drafter_checkpoint("ev", final, "_COMMIT.json")))
    # A checkpoint carries the latest eval written before it: an earlier step's, or its own
    # when a periodic eval fell on the step that ends a shard.
    assert float(commit["metrics"]["tau"]) >= 1.0 and int(commit["metrics"]["tau_step"]) <= final
    down = wait_until(lambda: (d := pipeline.read_status("ev")["downstream"])["tau_step"] == final
                      and d, 60, "the eval of the final checkpoint")
    assert down["tau"] >= 1.0 and down["eval_error"] is None
    assert len(down["train"]["tau_per_position"]) == 15

    result = pipeline.cli("eval-drafter", "--run", "ev", "--max-new-tokens", "48", "--json",
                          check=True)
    out = json.loads(result.stdout)
    assert FIELDS <= set(out) and out["step"] == final and out["source"] == "heldout"
    assert out["prompts"] == 3 and out["tokens"] > 3
    assert out["lossless"] == {"checked": 3, "mismatches": []}
    assert sum(out["accepted_hist"].values()) == out["steps"] > 0
    assert len(out["per_position"]) == 15 and out["tau"] >= 1.0

    # An exported drafter on prompts of a file, in one process: the text report names both.
    export = tmp_path / "export"
    pipeline.cli("export-drafter", "--run", "ev", "--out", str(export), check=True)
    text = pipeline.cli("eval-drafter", "--run", "ev", "--drafter", str(export), "--prompts",
                        str(MT_BENCH), "--num", "2", "--max-new-tokens", "24", "--block-size",
                        "4", check=True).stdout
    assert f"drafter {export} on 2 " in text and "block 4" in text, text
    assert "2/2 prompts decode exactly" in text, text

    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "hidden_size": 999}))
    unfit = pipeline.cli("eval-drafter", "--run", "ev", "--drafter", str(export))
    assert unfit.returncode == 1 and "does not fit the target: hidden size 999" in unfit.stderr
    (export / "model.safetensors").unlink()
    bad = pipeline.cli("eval-drafter", "--run", "ev", "--drafter", str(export))
    assert bad.returncode == 1 and "not a drafter export" in bad.stderr
    missing = pipeline.cli("eval-drafter", "--run", "ev", "--step", "99999")
    assert missing.returncode == 1 and "no checkpoint at step 99999" in missing.stderr


def test_a_failing_eval_is_recorded_and_training_goes_on(pipeline: Pipeline,
                                                         tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(12))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    pipeline.start_worker("gen")
    trainer = pipeline.start_worker("trainer", kind="train", **{
        **TRAIN_ENV, "DFLASH_TRAIN_EVAL_STEPS": "2", "DFLASH_TEST_FAULT": "eval=eval exploded"})
    pipeline.cli("enqueue", "--input", src, "--run", "bad", "--shard-size", "4", "--mode",
                 "online", "--max-new-tokens", "64", "--heldout-min", "2", check=True)
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
                 "online", "--heldout-min", "3", check=True)
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
