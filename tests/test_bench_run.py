"""``bench --run``: the run's own prompts on the engine a worker would start, MTP off and on,
and the projection of the run's hours; checked by hand at the seed's size.

The engine is the simulator started through ``--engine-cmd ... {engine_args}`` (it models
speculative decoding: a step's time grows with the tokens it verifies), so MTP wins at a small,
memory-bound batch and loses at a large, compute-bound one, as on a GPU (the figures:
benchmarks/mtp_speed.py). What is asserted is which configuration wins, by a modelled margin of
about 2x either way, never a rate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from producer.bench import BenchRow
from producer.projection import SEED_SAMPLES, project
from tests.conftest import HYBRID, Pipeline, TinyTarget
from tests.test_generate_e2e import _write_jsonl

SIM_BASE = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
            "--model-path {model} --max-running 256 --decode-base-ms 4 --decode-per-req-ms 0.1 "
            "--len-mu 5 --len-sigma 0.3 ")
SIM_CMD = SIM_BASE + "--accept-length 2.5 {engine_args}"
# At 4 in flight: 2x faster through MTP (3.5 tokens a step), or 3x slower (1.05, dear drafts).
FAST_CMD = SIM_BASE + "--accept-length 3.5 {engine_args}"
SLOW_CMD = SIM_BASE + "--accept-length 1.05 --draft-step-ms 4 {engine_args}"


def _row(mtp: str, concurrency: int, tokens_per_s: float) -> BenchRow:
    return BenchRow(concurrency, 100, round(tokens_per_s * 10), 10.0, 1.0, 2.0, mtp=mtp)


def test_the_projection_is_the_hand_arithmetic_at_the_seeds_size() -> None:
    rows = [_row("off", 16, 900.0), _row("off", 64, 1500.0), _row("on", 16, 2000.0),
            _row("on", 64, 3600.0)]
    # 1,000 committed samples of 3,000,000 output tokens: 3,000 a sample; 8 GPUs, one engine each.
    p = project(rows, SEED_SAMPLES, (1000, 3_000_000), bench_turns=1.0, gpus=8)
    assert p.remaining_output_tokens == 902_087 * 3000 == 2_706_261_000
    assert p.hours["off"] == pytest.approx(2_706_261_000 / (1500 * 8) / 3600, rel=1e-12)
    assert p.hours["on"] == pytest.approx(2_706_261_000 / (3600 * 8) / 3600, rel=1e-12)
    assert round(p.hours["off"], 2) == 62.64 and round(p.hours["on"], 2) == 26.10
    assert p.best == "on" and p.concurrency == {"off": 64, "on": 64}
    as_json = p.to_json()
    assert as_json["hours"] == {"off": 62.644931, "on": 26.102054} and as_json["gpus"] == 8
    # Tensor parallel 2: 4 engines on the 8 GPUs, twice the hours.
    assert project(rows, SEED_SAMPLES, (1000, 3_000_000), 1.0, 8, tp=2).hours["on"] \
        == pytest.approx(2 * p.hours["on"])
    # Before any commit: the bench's own replies (mean tokens per reply x turns per row).
    early = project(rows, SEED_SAMPLES, (0, 0), bench_turns=2.0, gpus=8)
    per_reply = sum(r.output_tokens for r in rows) / sum(r.requests for r in rows)
    assert early.source == "bench" and early.tokens_per_sample == pytest.approx(2 * per_reply)


def _bench(pipeline: Pipeline, run: str, *args: str, cmd: str = SIM_CMD) -> dict:
    result = pipeline.cli("bench", "--run", run, "--engine", "sglang", "--engine-cmd", cmd,
                          "--gpus", "8", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _rows(n: int) -> list[dict]:
    return [{"question_id": i, "category": "bench", "turns": [
        f"Question {i}: explain, step by step, why the sky at dusk turns {i % 7} shades red."]}
        for i in range(n)]


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_mtp_wins_at_a_memory_bound_batch_and_loses_at_a_compute_bound_one(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _rows(128))
    pipeline.cli("enqueue", "--input", src, "--run", "speed", "--model", target_model.name,
                 "--shard-size", "64", "--max-new-tokens", "600", check=True)
    small = _bench(pipeline, "speed", "--concurrency", "2", "--num", "8")
    rate = {r["mtp"]: r for r in small["rows"]}
    assert set(rate) == {"off", "on"}, "a target with an MTP head is benched both ways"
    assert rate["off"]["accept_length"] is None and 1.5 < rate["on"]["accept_length"] <= 4
    assert rate["on"]["total_output_tokens"] == rate["off"]["total_output_tokens"], "lossless"
    assert all(r["conversations"] == 8 for r in small["rows"])
    assert rate["on"]["output_tokens_per_s"] > rate["off"]["output_tokens_per_s"]
    projection = small["projection"]
    assert projection["hours"]["on"] < projection["hours"]["off"] and projection["best"] == "on"
    # The projection is its own rows' arithmetic: 128 rows left, tokens per whole conversation.
    tokens = projection["remaining_output_tokens"]
    assert projection["remaining_samples"] == 128 and projection["gpus"] == 8
    assert tokens == round(128 * sum(r["total_output_tokens"] for r in small["rows"])
                           / sum(r["conversations"] for r in small["rows"]))
    for mode, row in rate.items():
        hours = tokens / (row["output_tokens_per_s"] * 8) / 3600
        assert projection["hours"][mode] == pytest.approx(hours, rel=0.01)

    large = _bench(pipeline, "speed", "--concurrency", "128", "--num", "128", "--mtp", "off,on")
    rate = {r["mtp"]: r for r in large["rows"]}
    assert rate["on"]["output_tokens_per_s"] < rate["off"]["output_tokens_per_s"]
    assert large["projection"]["best"] == "off"
    table = pipeline.cli("bench", "--run", "speed", "--engine", "sglang", "--engine-cmd",
                         SIM_CMD, "--concurrency", "2", "--num", "4", "--mtp", "on")
    assert table.returncode == 0, table.stderr
    assert "accept" in table.stdout and "projection: 128 samples left" in table.stdout
    assert "window s" in table.stdout and "verdict: - (not stored: MTP on and off" in table.stdout


def test_bench_run_refuses_bad_input_with_one_line(pipeline: Pipeline, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", _rows(4))
    pipeline.cli("enqueue", "--input", src, "--run", "dense", "--shard-size", "4",
                 "--max-new-tokens", "64", check=True)   # tiny-qwen3: no MTP head
    base = ("bench", "--run", "dense", "--engine", "sglang", "--engine-cmd", SIM_CMD)
    for args, words in [((*base, "--mtp", "on"), "the target states no MTP head"),
                        ((*base, "--mtp", "maybe"), "give off, on or off,on"),
                        ((*base, "--prompt-len", "9"), "--prompt-len is for synthetic"),
                        ((*base, "--tp", "2"), "--gpus 1 holds no engine of --tp 2"),
                        (("bench", "--run", "dense"), "--engine sglang"),
                        ((*base, "--engine-url", "http://127.0.0.1:1", "--mtp", "off"),
                         "--engine-url's server is measured as it runs"),
                        (("bench", "--engine-url", "http://127.0.0.1:1", "--mtp", "on"),
                         "--mtp needs --run")]:
        result = pipeline.cli(*args)
        errors = [line for line in result.stderr.splitlines() if "rror" in line]
        assert result.returncode == 2 and len(errors) == 1 and words in errors[0], \
            (args, result.stderr)
    missing = pipeline.cli(*base[:2], "nope", *base[3:])
    assert missing.returncode == 1 and "nope" in missing.stderr
    plain = json.loads(pipeline.cli(*base, "--concurrency", "2", "--num", "4", "--json",
                                    check=True).stdout)
    assert {r["mtp"] for r in plain["rows"]} == {"off"} and plain["projection"]["best"] == "off"


def _choice_lines(pipeline: Pipeline, name: str, run: str) -> list[str]:
    log = (pipeline.log_dir / f"{name}.log").read_text()
    return [line for line in log.splitlines() if f"run {run}: mtp " in line]


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_auto_follows_the_runs_own_bench(pipeline: Pipeline, tmp_path: Path,
                                         target_model: TinyTarget) -> None:
    """A bench that finds MTP slower makes ``--mtp auto`` generate the run without it; one that
    finds it faster, through it. Each worker starts its engine with MTP on (the head's rule) and
    relaunches it where the run's verdict says off."""
    from tests.conftest import free_port
    from tests.test_generate_e2e import _committed_samples, _mt_bench_rows

    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))   # two turns each
    pipeline.env["DFLASH_MODEL"] = target_model.name   # the workers' target
    for run, cmd, winner in (("slow", SLOW_CMD, "off"), ("fast", FAST_CMD, "on")):
        pipeline.cli("enqueue", "--input", src, "--run", run, "--model", target_model.name,
                     "--shard-size", "4", "--max-new-tokens", "300", "--max-reject-rate", "1",
                     "--skip-gate", "duplicates", check=True)
        bench = _bench(pipeline, run, "--concurrency", "4", "--num", "8", cmd=cmd)
        rate = {r["mtp"]: r["output_tokens_per_s"] for r in bench["rows"]}
        assert (rate["on"] > rate["off"]) == (winner == "on"), rate
        assert all(r["steady"] for r in bench["rows"]), bench["rows"]
        assert bench["verdict"]["key"].startswith(f"runs/{run}/bench/unknown-tp1-")
        worker = pipeline.start_worker(f"w{run}", "--engine", "sglang", "--engine-cmd", cmd,
                                       "--max-in-flight", "4", "--mtp", "auto",
                                       DFLASH_ENGINE_PORT=str(free_port()))
        pipeline.wait_done(run, timeout=300)
        lines = _choice_lines(pipeline, f"w{run}", run)
        assert len(lines) == 1 and f"mtp {winner} (auto): bench " in lines[0], lines
        assert "at concurrency 4" in lines[0]
        mine = next(v for k, v in pipeline.status(run)["mtp"].items() if k.startswith(f"w{run}@"))
        assert mine["mtp"] == winner and mine["reason"].startswith("bench ")
        algorithms = {s["engine"].get("speculative_algorithm")
                      for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], run)}
        assert algorithms == ({"NEXTN"} if winner == "on" else {None}), algorithms
        worker.terminate()
        worker.wait(timeout=60)
