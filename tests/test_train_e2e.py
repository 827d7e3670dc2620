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
from common.runs.checkpoints import best_step, committed_steps, load_checkpoint, read_ledger
from common.runs.records import InputManifest
from common.runs.store import RunStore
from common.storage import open_storage
from tests.conftest import MT_BENCH, Pipeline, TinyTarget, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.tolerance import worst

pytestmark = pytest.mark.e2e

TRAIN_ENV = {"DFLASH_TRAIN_CHECKPOINT_STEPS": "2", "DFLASH_TRAIN_ROWS_PER_STEP": "4",
             "DFLASH_TRAIN_EVAL_PROMPTS": "1",
             "DFLASH_TRAIN_EVAL_MAX_NEW_TOKENS": "16",
             # A step's dense attention grows with the square of its blocks: 16 per row keep
             # each CPU step about a second (DFlash's 512 took 4-10 s on these rows).
             "DFLASH_TRAIN_MAX_ANCHORS": "16"}
EVAL_FIELDS = {"tau", "tau_pooled", "accepted_hist", "per_position", "prompts", "tokens"}


# Five sliding-window layers, as SpecForge's Qwen3.6 drafters, with a window (24) well below
# the rows (128 generated tokens after the prompt), and its own heads.
SLIDING_DRAFTER = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                   "num_hidden_layers": 5, "layer_types": ["sliding_attention"] * 5,
                   "sliding_window": 24, "use_sliding_window": True,
                   "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                   "block_size": 16, "dflash_config": {"mask_token_id": None}}


def start_train_worker(pipeline: Pipeline, name: str, *args: str,
                       **env: str) -> subprocess.Popen[bytes]:
    return pipeline.start_worker(name, *args, kind="train", **{**TRAIN_ENV, **env})


def adam_steps(state: dict) -> set[int]:
    return {int(s["step"]) for s in state["optimizer"]["state"].values()}


def test_online_training_survives_kill9_and_exports(pipeline: Pipeline, tmp_path: Path,
                                                    target_model: TinyTarget) -> None:
    """Enqueue (context checked from the target's settings), generate, train a drafter of five
    sliding-window layers (--drafter-config) with the periodic eval on, kill -9 the trainer,
    export, doctor --drafter, eval-drafter: on both targets."""
    pipeline.env["DFLASH_MODEL"] = target_model.name
    shape = tmp_path / "sliding.json"
    shape.write_text(json.dumps(SLIDING_DRAFTER))
    evals = {"DFLASH_TRAIN_EVAL_STEPS": "2"}
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    victim = start_train_worker(pipeline, "trainer", **evals)
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "on", "--shard-size", "4", "--mode",
                 "online", "--epochs", "1", "--drafter-config", str(shape),
                 "--max-new-tokens", "128", "--heldout-min", "2", check=True)
    wait_until(lambda: committed_steps(storage, "on"), 240, "a first drafter checkpoint")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    before = committed_steps(storage, "on")[-1]
    assert len(read_ledger(storage, "on").done) < 4, "training ended before the kill"
    before_state, _ = load_checkpoint(storage, "on", before)
    assert adam_steps(before_state) == {before}

    survivor = start_train_worker(pipeline, "trainer2", **evals)
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
    exported = json.loads(result.stdout)   # by default the checkpoint with the best tau
    assert exported["chosen"] == "best-tau"
    assert (exported["step"], exported["tau"]) == best_step(storage, "on")
    state, _ = load_checkpoint(storage, "on", exported["step"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    assert set(config["dflash_config"]) >= {"mask_token_id", "target_layer_ids"}
    assert config["layer_types"] == ["sliding_attention"] * 5 and config["sliding_window"] == 24
    assert config["use_sliding_window"] is True and "is_causal" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert not [k for k in weights if "embed_tokens" in k or "lm_head" in k]
    assert torch.equal(weights["fc.weight"].float(), state["drafter"]["fc.weight"].float())

    # Both targets carry spare vocabulary rows: the mask token takes one, the export serves.
    doctor = pipeline.cli("doctor", "--json", "--drafter", str(out))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = json.loads(doctor.stdout)["checks"]
    rows = {c["name"]: c for c in checks if c["name"].startswith("drafter")}
    assert {c["status"] for c in rows.values()} == {"PASS"}, checks
    assert "5 sliding (window 24" in rows["drafter attention layers"]["detail"]
    if target_model.hybrid:
        measured = json.loads(pipeline.cli("eval-drafter", "--run", "on", "--drafter", str(out),
                                           "--max-new-tokens", "32", "--json", check=True).stdout)
        assert measured["lossless"]["checked"] >= 1 and measured["lossless"]["mismatches"] == []
    else:                     # the command's sources and errors, and --init-drafter, once
        survivor.send_signal(signal.SIGTERM)   # the next run's drafter is the heir's alone
        survivor.wait(timeout=60)
        check_init_drafter(pipeline, tmp_path, out, storage)
        check_eval_drafter_command(pipeline, storage, final, out)


def pipeline_target(pipeline: Pipeline) -> Path:
    from common.config import load_settings
    from common.engine.models import resolve_model_path

    return resolve_model_path(load_settings(model=pipeline.env["DFLASH_MODEL"],
                                            cache_dir=pipeline.env["DFLASH_CACHE_DIR"]))


def check_init_drafter(pipeline: Pipeline, tmp_path: Path, export: Path, storage: object) -> None:
    """A new run started from run "on"'s export: its first checkpoint grew from those weights
    (not a fresh drafter's), and its own export has the same shape."""
    from safetensors.torch import load_file

    src = _write_jsonl(tmp_path / "more.jsonl", _mt_bench_rows(20)[16:])
    start_train_worker(pipeline, "heir", DFLASH_TRAIN_CHECKPOINT_STEPS="1")
    pipeline.cli("enqueue", "--input", src, "--run", "on2", "--shard-size", "4", "--mode",
                 "online", "--epochs", "1", "--init-drafter", str(export),
                 "--max-new-tokens", "128", "--heldout-min", "0", check=True)
    wait_until(lambda: committed_steps(storage, "on2"), 240, "the heir's first checkpoint")
    first, _ = load_checkpoint(storage, "on2", committed_steps(storage, "on2")[0])
    released = load_file(str(export / "model.safetensors"))
    # One step (lr at most 3e-4 in warm-up) from the released weights.
    from common.drafter.origin import freeze_origin
    from common.engine.target import TargetShape
    from workers.train.drafter.model import add_mask_token
    from workers.train.drafter.origin import new_drafter
    from workers.train.drafter.target_loader import load_target

    target, tokenizer = load_target(pipeline_target(pipeline))
    fresh = new_drafter(target, add_mask_token(tokenizer, target), first["drafter_config"][
        "target_layer_ids"], freeze_origin(str(tmp_path / "sliding.json"), None,
                                           TargetShape.of(target.config)))
    # Each tensor's difference on its own scale: the first checkpoint is one step from the
    # export, a fresh drafter of the same shape (the same init seed) as far as run "on"'s steps
    # took it (measured: 0.008 against 0.042).
    drift = max(worst(first["drafter"][k], released[k]) for k in released)
    apart = max(worst(fresh.state_dict()[k], released[k]) for k in released)
    assert drift < apart / 2, (drift, apart)
    out = tmp_path / "export2"
    pipeline.cli("export-drafter", "--run", "on2", "--out", str(out), check=True)
    again = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in again.items() if k != "dtype"} == \
        {k: v for k, v in json.loads((export / "config.json").read_text()).items()
         if k != "dtype"}


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
    # Rows cut to their first 96 tokens (prompts are ~40-70): the stored states are cut too.
    pipeline.cli("enqueue", "--input", src, "--run", "off", "--shard-size", "4", "--epochs", "2",
                 "--max-new-tokens", "128", "--heldout-min", "1", "--max-train-tokens", "96",
                 check=True)
    # Two epochs over the stored states, the schedule made from them as online.
    wait_until(lambda: read_ledger(storage, "off").finished, 240,
               "two epochs trained from stored hidden states")
    assert len([k for k in storage.list(keys.hidden_prefix("off"))
                if k.endswith("/_COMMIT.json")]) == 2
    ledger = read_ledger(storage, "off")
    assert (ledger.epoch, sorted(ledger.done), ledger.finished) == (1, [0, 1], "schedule")
    state, _ = load_checkpoint(storage, "off")
    per_epoch = sum(ledger.shard_steps.values())
    assert state["steps"] == 2 * per_epoch == state["schedule"]["total"] >= 2
    assert adam_steps(state) == {state["steps"]} and len(ledger.tau_by_epoch) == 2
    log = (pipeline.log_dir / "trainer.log").read_text()
    assert "run off shard 0: step" in log and trainer.poll() is None
    # Status counts the rows longer than 96 tokens (held-out samples aside) as cut.
    store = RunStore(storage, "off")
    rows = [row for shard in store.committed() for row in store.training_rows(shard)]
    heldout = store.manifest().heldout_ids
    aside = pipeline.status("off")["downstream"]["rows_set_aside"]
    assert aside["cut"] == sum(len(r.input_ids) > 96 for r in rows
                               if r.sample_id not in heldout) > 0, aside
    assert f"{aside['cut']} cut to the run's --max-train-tokens" in pipeline.cli(
        "status", "--run", "off", check=True).stdout
    # plan-training reads the committed rows' lengths from the commits (cut as the run cuts).
    plan = json.loads(pipeline.cli("plan-training", "--run", "off", "--gpu-memory-gib", "80",
                                   "--json", check=True).stdout)
    assert sorted(store.row_lengths(0) + store.row_lengths(1)) == sorted(
        (len(r.input_ids), r.supervised_tokens) for r in rows)
    assert plan["rows"] == len(rows) and plan["tokens"] == 96 and plan["fits"]
