"""Online drafter training end to end: generate -> train queue -> checkpoints, kill -9, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from common import keys
from common.drafter_store import committed_steps, load_checkpoint, read_ledger
from common.records import InputManifest
from common.storage import open_storage
from tests.conftest import MT_BENCH, Pipeline, TinyTarget, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl

pytestmark = pytest.mark.e2e

TRAIN_ENV = {"DFLASH_TRAIN_CHECKPOINT_STEPS": "2", "DFLASH_TRAIN_ROWS_PER_STEP": "4",
             "DFLASH_TRAIN_TOTAL_STEPS": "40", "DFLASH_TRAIN_EVAL_PROMPTS": "1",
             "DFLASH_TRAIN_EVAL_MAX_NEW_TOKENS": "16",
             # A step's dense attention grows with the square of its blocks: 16 per row keep
             # each CPU step about a second (DFlash's 512 took 4-10 s on these rows).
             "DFLASH_TRAIN_MAX_ANCHORS": "16"}
EVAL_FIELDS = {"tau", "tau_pooled", "accepted_hist", "per_position", "prompts", "tokens"}


def start_train_worker(pipeline: Pipeline, name: str, **env: str) -> subprocess.Popen[bytes]:
    return pipeline.start_worker(name, kind="train", **{**TRAIN_ENV, **env})


def adam_steps(state: dict) -> set[int]:
    return {int(s["step"]) for s in state["optimizer"]["state"].values()}


def test_online_training_survives_kill9_and_exports(pipeline: Pipeline, tmp_path: Path,
                                                    target_model: TinyTarget) -> None:
    """Enqueue (context checked from the target's settings), generate, train with the periodic
    eval on, kill -9 the trainer, export, doctor --drafter, eval-drafter: on both targets."""
    pipeline.env["DFLASH_MODEL"] = target_model.name
    evals = {"DFLASH_TRAIN_EVAL_STEPS": "2"}
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    victim = start_train_worker(pipeline, "trainer", **evals)
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "on", "--shard-size", "4", "--mode",
                 "online", "--max-new-tokens", "128", "--heldout-min", "2", check=True)
    wait_until(lambda: committed_steps(storage, "on"), 240, "a first drafter checkpoint")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    before = committed_steps(storage, "on")[-1]
    assert len(read_ledger(storage, "on").done) < 4, "training ended before the kill"
    before_state, _ = load_checkpoint(storage, "on", before)
    assert adam_steps(before_state) == {before}

    start_train_worker(pipeline, "trainer2", **evals)
    pipeline.wait_done("on")
    pipeline.cli("resume", "--run", "on", check=True)  # shards acked after the last checkpoint
    wait_until(lambda: sorted(read_ledger(storage, "on").done) == [0, 1, 2, 3], 240,
               "every shard in the ledger")
    ledger = read_ledger(storage, "on")
    assert len(ledger.done) == len(set(ledger.done)) == 4 and not ledger.partial
    final = committed_steps(storage, "on")[-1]
    state, _ = load_checkpoint(storage, "on", final)
    # AdamW's per-parameter step count went on from the checkpoint instead of restarting.
    assert final > before and adam_steps(state) == {final} == {state["steps"]}
    assert state["train_config"]["max_anchors"] == 16    # the worker's setting, kept on resume
    assert not list(storage.list(keys.hidden_prefix("on"))), "online mode stored hidden states"
    down = pipeline.status("on")["downstream"]
    assert down["mode"] == "online" and down["committed"] == 4
    assert down["train"]["step"] and len(down["train"]["slot_accuracy"]) == 15
    commit = json.loads(storage.get(keys.drafter_checkpoint("on", final, "_COMMIT.json")))
    assert commit["metrics"]["loss"] and json.loads(storage.get(keys.drafter_latest("on"))) \
        ["step"] == final
    # The eval ran after the checkpoint was written and measured tau at that step.
    assert float(commit["metrics"]["tau"]) >= 1.0 and not commit["metrics"].get("eval_error")

    out = tmp_path / "export"
    result = pipeline.cli("export-drafter", "--run", "on", "--out", str(out), "--json",
                          check=True)
    assert json.loads(result.stdout)["step"] == final
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    assert set(config["dflash_config"]) >= {"mask_token_id", "target_layer_ids"}
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert not [k for k in weights if "embed_tokens" in k or "lm_head" in k]
    assert torch.equal(weights["fc.weight"].float(), state["drafter"]["fc.weight"].float())

    if target_model.hybrid:   # its mask token takes a spare row: the export serves as it is
        measured = json.loads(pipeline.cli("eval-drafter", "--run", "on", "--drafter", str(out),
                                           "--max-new-tokens", "32", "--json", check=True).stdout)
        assert measured["lossless"]["checked"] >= 1 and measured["lossless"]["mismatches"] == []
        doctor = pipeline.cli("doctor", "--json", "--drafter", str(out))
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        checks = json.loads(doctor.stdout)["checks"]
        rows = {c["status"] for c in checks if c["name"].startswith("drafter")}
        assert rows == {"PASS"}, checks
    else:                     # the command's sources and errors, once
        check_eval_drafter_command(pipeline, storage, final, out)


def check_eval_drafter_command(pipeline: Pipeline, storage: object, final: int,
                               export: Path) -> None:
    """eval-drafter on run "on" (finished, trained to ``final``): the status' tau, the run's
    own checkpoint on its held-out split, an export on a prompt file, and every refusal."""
    down = wait_until(lambda: (d := pipeline.read_status("on")["downstream"])["tau_step"] == final
                      and d, 60, "the eval of the final checkpoint")
    assert down["tau"] >= 1.0 and down["eval_error"] is None
    assert len(down["train"]["tau_per_position"]) == 15
    manifest = InputManifest.from_json(json.loads(storage.get(keys.inputs_manifest("on"))))

    out = json.loads(pipeline.cli("eval-drafter", "--run", "on", "--max-new-tokens", "48",
                                  "--json", check=True).stdout)
    assert EVAL_FIELDS <= set(out) and out["step"] == final and out["source"] == "heldout"
    held = len(manifest.heldout)
    assert out["prompts"] == held and out["tokens"] > held
    assert out["lossless"] == {"checked": held, "mismatches": []}
    assert sum(out["accepted_hist"].values()) == out["steps"] > 0
    assert len(out["per_position"]) == 15 and out["tau"] >= 1.0

    text = pipeline.cli("eval-drafter", "--run", "on", "--drafter", str(export), "--prompts",
                        str(MT_BENCH), "--num", "2", "--max-new-tokens", "24", "--block-size",
                        "4", check=True).stdout
    assert f"drafter {export} on 2 " in text and "block 4" in text, text
    assert "2/2 prompts decode exactly" in text, text

    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "hidden_size": 999}))
    unfit = pipeline.cli("eval-drafter", "--run", "on", "--drafter", str(export))
    assert unfit.returncode == 1 and "does not fit the target: hidden size 999" in unfit.stderr
    (export / "model.safetensors").unlink()
    bad = pipeline.cli("eval-drafter", "--run", "on", "--drafter", str(export))
    assert bad.returncode == 1 and "not a drafter export" in bad.stderr
    missing = pipeline.cli("eval-drafter", "--run", "on", "--step", "99999")
    assert missing.returncode == 1 and "no checkpoint at step 99999" in missing.stderr
    unknown = pipeline.cli("eval-drafter", "--run", "nosuch")
    assert unknown.returncode == 1 and "not found" in unknown.stderr, unknown.stderr


def test_offline_run_trains_from_the_stored_hidden_states(pipeline: Pipeline, tmp_path: Path
                                                          ) -> None:
    from tests.test_hidden_e2e import start_hidden_worker

    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    pipeline.start_worker("gen")
    start_hidden_worker(pipeline, "hid")
    trainer = start_train_worker(pipeline, "trainer")
    pipeline.cli("enqueue", "--input", src, "--run", "off", "--shard-size", "4",
                 "--max-new-tokens", "128", "--heldout-min", "1", check=True)
    wait_until(lambda: sorted(read_ledger(storage, "off").done) == [0, 1], 240,
               "both shards trained from stored hidden states")
    assert len([k for k in storage.list(keys.hidden_prefix("off"))
                if k.endswith("/_COMMIT.json")]) == 2
    state, _ = load_checkpoint(storage, "off")
    assert state["steps"] >= 2 and adam_steps(state) == {state["steps"]}
    log = (pipeline.log_dir / "trainer.log").read_text()
    assert "run off shard 0: step" in log and trainer.poll() is None
