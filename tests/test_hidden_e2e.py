"""Second queue end to end: generate -> hidden-state workers -> safetensors shards in S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from common import keys
from common.drafter.layers import layer_ids
from common.engine.target import TargetShape
from common.hidden.store import iter_hidden_records
from common.runs.store import RunStore
from common.storage import open_storage
from tests.conftest import HYBRID, Pipeline, TinyTarget, wait_until
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl
from tests.tolerance import assert_close

pytestmark = pytest.mark.e2e


def start_hidden_worker(pipeline: Pipeline, name: str, **env: str) -> subprocess.Popen[bytes]:
    return pipeline.start_worker(name, kind="hidden", **env)


def hidden_commits(storage, run: str) -> list[str]:  # noqa: ANN001
    return [k for k in storage.list(keys.hidden_prefix(run)) if k.endswith("/_COMMIT.json")]


def reference(model, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    with torch.inference_mode():
        states = model(input_ids=ids[None].long(), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in layers], dim=-1), states[-1][0]


# Both layouts on the dense target; the hybrid in one representative case (each run is slow).
@pytest.mark.parametrize(("layout", "target_model"), [
    ("dflash", "tiny-qwen3"), ("eagle3", "tiny-qwen3"), ("dflash", HYBRID)],
    indirect=["target_model"])
def test_hidden_states_match_a_direct_forward(pipeline: Pipeline, tmp_path: Path,
                                              target_model: TinyTarget, layout: str) -> None:
    from transformers import AutoModelForCausalLM

    pipeline.env["DFLASH_MODEL"] = target_model.name
    # The hybrid runs torch's slow Gated DeltaNet fallback: 2 rows instead of 6, still 2 shards.
    rows, size = (2, "1") if target_model.hybrid else (6, "3")
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(rows))
    pipeline.start_worker("gen")
    start_hidden_worker(pipeline, "hid")
    pipeline.cli("enqueue", "--input", src, "--run", layout, "--shard-size", size, "--layout",
                 layout, "--max-new-tokens", "128", check=True)
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    wait_until(lambda: len(hidden_commits(storage, layout)) == 2,
               480 if target_model.hybrid else 240, "2 hidden commits")

    model = AutoModelForCausalLM.from_pretrained(target_model.path).eval()
    frozen = RunStore(storage, layout).config().target_layer_ids   # dflash: resolved at enqueue
    layers = frozen or layer_ids(layout, TargetShape.of(model).num_layers, 5)
    samples = {s["id"]: s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], layout)
               if s["quality"]["passed"]}
    records = list(iter_hidden_records(storage, layout))
    assert sorted((r["sample_id"], r["turn"]) for r in records) == sorted(
        (i, t) for i, s in samples.items() for t in range(len(s["turns"])))
    for record in records:
        turn = samples[record["sample_id"]]["turns"][record["turn"]]
        assert record["input_ids"].tolist() == turn["prompt_ids"] + turn["output_ids"]
        assert int(record["loss_mask"].sum()) == len(turn["output_ids"])
        assert record["hidden_states"].dtype == torch.bfloat16
        features, last = reference(model, record["input_ids"], layers)
        assert record["hidden_states"].shape == features.shape
        assert_close(record["hidden_states"], features, rel=2e-2)   # stored as bf16
        if layout == "eagle3":
            assert_close(record["last_hidden_states"], last, rel=2e-2)
        else:
            assert "last_hidden_states" not in record


def generated_run(pipeline: Pipeline, tmp_path: Path, run: str):  # noqa: ANN201
    """A generate worker runs 8 MT-Bench rows in 2 shards to the end; returns the storage."""
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", run, "--shard-size", "4",
                 "--max-new-tokens", "128", check=True)
    pipeline.wait_done(run)
    return open_storage(pipeline.env["DFLASH_STORAGE"])


def test_hidden_worker_killed_mid_shard_then_resume(pipeline: Pipeline, tmp_path: Path) -> None:
    storage = generated_run(pipeline, tmp_path, "hk")
    client = __import__("redis").Redis.from_url(pipeline.env["DFLASH_BROKER_URL"])
    # Tiny parts and one row per forward, so the shard is mid-way when the lease shows up.
    victim = start_hidden_worker(pipeline, "victim", DFLASH_HIDDEN_PART_BYTES="1",
                                 DFLASH_HIDDEN_BATCH_TOKENS="1")
    wait_until(lambda: list(client.scan_iter("dflash:hk:hidden:lease:*")), 60,
               "the hidden worker to lease a shard")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert len(hidden_commits(storage, "hk")) < 2, "both shards finished before the kill"

    resumed = json.loads(pipeline.cli("resume", "--run", "hk", "--json", check=True).stdout)
    assert resumed["downstream"] >= 1
    start_hidden_worker(pipeline, "rescuer", DFLASH_HIDDEN_PART_BYTES="1")
    wait_until(lambda: len(hidden_commits(storage, "hk")) == 2, 120, "both shards committed")
    records = [(r["sample_id"], r["turn"]) for r in iter_hidden_records(storage, "hk")]
    accepted = [s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "hk")
                if s["quality"]["passed"]]
    assert len(records) == len(set(records)) == sum(len(s["turns"]) for s in accepted)
    again = json.loads(pipeline.cli("resume", "--run", "hk", "--json", check=True).stdout)
    assert again["downstream"] == 0
    assert pipeline.status("hk")["downstream"] == {
        "mode": "offline", "stage": "hidden", "committed": 2, "parked": 0,
        "rows_set_aside": {"too_short": 0, "too_long": 0, "cut": 0}}   # no trainer ran
