"""The whole pipeline generating through the target's MTP head (``worker generate --mtp on``):
real Redis, a real worker, moto's S3, and the simulator standing in for SGLang on a GPU,
launched with the flags the worker passes (``{engine_args}``: NEXTN, the hybrid's mamba cache
strategy, the running cap). The figures are stored per turn and shown per worker by status, the
dashboard's Engines panel and the worker's metrics; MTP off stores the same tokens, no figures.
Sampling through MTP where SGLang's verify commits the argmax (the CPU), or with a parameter
its verify does not apply exactly (min-p, penalties), parks the run's shards under ``--mtp on``
and runs them without MTP under ``auto``. The simulator commits its tokens through a real
draft-and-verify step, so "the same tokens" below would fail for a broken verify
(tests/test_simulator_spec.py breaks it on purpose).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import HYBRID, Pipeline, TinyTarget, free_port, wait_until
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl
from tests.ui_support import running_ui

pytestmark = pytest.mark.e2e

SIM_CMD = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           "--model-path {model} --time-scale 0.05 --len-mu 4.8 --len-sigma 0.3 {engine_args}")
GATES = ("--max-new-tokens", "600", "--min-supervised-tokens", "4", "--max-reject-rate", "1",
         "--skip-gate", "duplicates", "--shard-size", "4")


def _enqueue(pipeline: Pipeline, src: str, run: str, *extra: str) -> None:
    pipeline.cli("enqueue", "--input", src, "--run", run, *GATES, *extra, check=True)


def _worker(pipeline: Pipeline, name: str, *args: str, **env: str):  # noqa: ANN202
    return pipeline.start_worker(name, "--engine", "sglang", "--engine-cmd", SIM_CMD,
                                 "--max-in-flight", "8", *args,
                                 DFLASH_ENGINE_PORT=str(free_port()), **env)


def _stop(worker) -> None:  # noqa: ANN001
    worker.terminate()
    worker.wait(timeout=60)


def _mtp_lines(pipeline: Pipeline, name: str, run: str | None = None) -> list[str]:
    """The worker's line as its engine starts, or (``run``) its choice for that run."""
    log = (pipeline.log_dir / f"{name}.log").read_text()
    mark = "] engine starts with mtp " if run is None else f"] run {run}: mtp "
    return [line for line in log.splitlines() if mark in line]


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_the_pipeline_generates_through_mtp_and_keeps_the_figures(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    pipeline.env["DFLASH_MODEL"] = target_model.name
    _enqueue(pipeline, src, "with")
    metrics = free_port()
    worker = _worker(pipeline, "mtpw", "--mtp", "on", DFLASH_METRICS_PORT=str(metrics))
    pipeline.wait_done("with", timeout=300)
    lines = _mtp_lines(pipeline, "mtpw")
    assert len(lines) == 1 and "mtp on (on): asked on, SGLang on the GPU: NEXTN" in lines[0]
    ran = _mtp_lines(pipeline, "mtpw", "with")
    assert len(ran) == 1 and "mtp on (on): asked on: NEXTN, 3 steps" in ran[0], ran
    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "with")
    turns = [t for s in samples for t in s["turns"]]
    assert len(samples) == 8 and all(s["engine"]["speculative_algorithm"] == "NEXTN"
                                     for s in samples)
    for turn in turns:
        spec = turn["speculative"]
        assert spec["spec_verify_ct"] > 0 and spec["spec_accept_length"] == \
            turn["completion_tokens"] / spec["spec_verify_ct"]
    steps = sum(t["speculative"]["spec_verify_ct"] for t in turns)
    tokens = sum(t["completion_tokens"] for t in turns)

    status = pipeline.status("with")
    mine = next(v for k, v in status["speculative"].items() if k.startswith("mtpw@"))
    assert mine == {"algorithm": "NEXTN", "verify_steps": steps, "output_tokens": tokens,
                    "accept_length": round(tokens / steps, 3)}
    assert 1 < mine["accept_length"] <= 4
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert f'dflash_spec_accept_length{{run="with"}} {tokens / steps}' in text
    assert 'dflash_spec_algorithm{algorithm="NEXTN"} 1.0' in text
    with running_ui(pipeline.env, tmp_path / "ui.log") as board:
        engines = board.json("/api/runs/with/engines")["engines"]
    ours = [e for e in engines if (e["worker"] or "").startswith("mtpw@")]
    assert len(ours) == 1 and ours[0]["healthy"], engines
    assert (ours[0]["algorithm"], ours[0]["accept_length"]) == ("NEXTN", mine["accept_length"])
    _stop(worker)

    _enqueue(pipeline, src, "without")
    plain = _worker(pipeline, "plainw", "--mtp", "off")
    pipeline.wait_done("without", timeout=300)
    assert "mtp off (off): asked off" in _mtp_lines(pipeline, "plainw")[0]
    others = {s["id"]: s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "without")}
    for sample in samples:   # the same tokens, turn by turn; no figures without drafts
        other = others[sample["id"]]
        assert [t["output_ids"] for t in other["turns"]] == \
            [t["output_ids"] for t in sample["turns"]]
        assert "speculative" not in json.dumps(other["turns"])
        assert "speculative_algorithm" not in other["engine"]
    assert pipeline.status("without")["speculative"] == {}
    assert [m["mtp"] for m in pipeline.status("without")["mtp"].values()] == ["off"]
    _stop(plain)


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_a_sampler_the_verify_changes_parks_under_on_and_runs_plain_under_auto(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    """min-p (and a presence penalty) are not applied exactly by SGLang's verify: ``--mtp on``
    parks the run's shards naming the parameter; ``auto`` generates the run without MTP and
    ``status`` says why."""
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    pipeline.env["DFLASH_MODEL"] = target_model.name
    _enqueue(pipeline, src, "minp-on", "--min-p", "0.05")
    on = _worker(pipeline, "onw", "--mtp", "on")
    wait_until(lambda: pipeline.read_status("minp-on")["parked"], 120, "the shard to park")
    parked = pipeline.read_status("minp-on")["parked"]
    assert parked and all("--mtp on: NEXTN would not keep the target's distribution: min_p 0.05"
                          in p["reason"] for p in parked), parked
    assert pipeline.read_status("minp-on")["samples"]["done"] == 0
    _stop(on)
    _enqueue(pipeline, src, "minp-auto", "--min-p", "0.05", "--presence-penalty", "1.5")
    auto = _worker(pipeline, "autow", "--mtp", "auto")
    assert "mtp on (auto): the target states an MTP head" in _mtp_lines(pipeline, "autow")[0]
    pipeline.wait_done("minp-auto", timeout=300)
    assert "mtp off (auto): the run's sampling" in _mtp_lines(pipeline, "autow", "minp-auto")[0]
    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "minp-auto")
    assert len(samples) == 4 and "speculative" not in json.dumps(samples)
    status = pipeline.status("minp-auto")
    mine = next(v for k, v in status["mtp"].items() if k.startswith("autow@"))
    assert mine["mtp"] == "off" and mine["mode"] == "auto"
    assert "min_p 0.05" in mine["reason"] and "presence_penalty 1.5" in mine["reason"]
    shown = pipeline.cli("status", "--run", "minp-auto", check=True).stdout
    assert "off (auto): the run's sampling is not kept exactly" in shown
    _stop(auto)


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_sampling_through_mtp_on_the_cpu_parks_greedy_runs(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    pipeline.env["DFLASH_MODEL"] = target_model.name
    _enqueue(pipeline, src, "greedy", "--temperature", "0")
    _enqueue(pipeline, src, "sampled", "--temperature", "0.6")
    _worker(pipeline, "cpuw", "--mtp", "on", "--engine-args", "--device cpu")
    assert "SGLang on the CPU (greedy runs only)" in _mtp_lines(pipeline, "cpuw")[0]
    pipeline.wait_done("greedy", timeout=300)
    assert all(t["speculative"]["spec_verify_ct"] > 0 for s in
               _committed_samples(pipeline.env["DFLASH_STORAGE"], "greedy") for t in s["turns"])
    wait_until(lambda: pipeline.read_status("sampled")["parked"], 120, "the shard to park")
    parked = pipeline.read_status("sampled")["parked"]
    assert parked and all("_verify_uses_greedy" in p["reason"] for p in parked), parked
    assert pipeline.read_status("sampled")["samples"]["done"] == 0
