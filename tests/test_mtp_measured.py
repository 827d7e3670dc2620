"""``--mtp auto`` with no bench verdict for the worker measures (issue 66, point 3): a real
worker generates the run's own shards with MTP on for a window, then off, and keeps the faster;
its choice lines and ``status --json``'s ``mtp`` record give source ``measured`` and both rates.
A verdict stored mid-run through the verdict writer is followed from a later shard; one for
another model, SGLang or Python (stale) is ignored and said so.

The engine is the simulator through ``--engine-cmd ... {engine_args}``, its speed through MTP
set by its own knobs (``--accept-length``, ``--draft-step-ms``): about 2x faster at 4 in
flight, or 3x slower, so which configuration wins is asserted, never a rate.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from common.config import load_settings
from common.engine.engine_identity import EngineIdentity
from common.runs.bench_verdict import Decider, write_verdict
from common.storage import open_storage
from tests.conftest import HYBRID, Pipeline, TinyTarget, free_port, wait_until
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl

pytestmark = pytest.mark.e2e

SIM_BASE = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
            "--model-path {model} --max-running 256 --decode-base-ms 4 --decode-per-req-ms 0.1 "
            "--len-mu 4.6 --len-sigma 0.3 ")
FAST_CMD = SIM_BASE + "--accept-length 3.5 {engine_args}"
SLOW_CMD = SIM_BASE + "--accept-length 1.05 --draft-step-ms 4 {engine_args}"
MEASURED = re.compile(r"mtp (on|off) \(auto\): measured on the run's shards at this worker's "
                      r"load: mtp on ([\d,.]+) vs off ([\d,.]+) output tok/s")


def _enqueue(pipeline: Pipeline, src: str, run: str) -> None:
    pipeline.cli("enqueue", "--input", src, "--run", run, "--shard-size", "4",
                 "--max-new-tokens", "300", "--max-reject-rate", "1", "--min-supervised-tokens",
                 "4", "--skip-gate", "duplicates", check=True)


def _worker(pipeline: Pipeline, name: str, cmd: str):  # noqa: ANN202
    return pipeline.start_worker(name, "--engine", "sglang", "--engine-cmd", cmd,
                                 "--max-in-flight", "4", "--mtp", "auto",
                                 DFLASH_ENGINE_PORT=str(free_port()),
                                 DFLASH_MTP_MEASURE_WINDOW="2", DFLASH_MTP_SWITCH_DWELL="0")


def _log(pipeline: Pipeline, name: str) -> str:
    return (pipeline.log_dir / f"{name}.log").read_text()


def _choices(pipeline: Pipeline, name: str, run: str) -> list[str]:
    return [line for line in _log(pipeline, name).splitlines() if f"] run {run}: mtp " in line]


def _decider(pipeline: Pipeline, cmd: str) -> Decider:
    """The worker's decider, as the worker computes it (same settings, model and python)."""
    settings = load_settings(pipeline.env, engine="sglang", engine_cmd=cmd)
    return Decider.of(settings, settings.worker.gpu, dict(pipeline.env))


def _verdict(pipeline: Pipeline, run: str, decider: Decider, on: float, off: float) -> str:
    """Store a steady verdict at concurrency 4 through the verdict writer; its key."""
    rows = [{"mtp": mode, "concurrency": 4, "output_tokens_per_s": rate, "steady": True,
             "window_rates": [rate * 0.99, rate * 1.01], "in_flight_mean": 4.0}
            for mode, rate in (("on", on), ("off", off))]
    written = write_verdict(open_storage(pipeline.env["DFLASH_STORAGE"]), run, decider, rows)
    assert written is not None
    return written[0]


def _record(pipeline: Pipeline, run: str, name: str) -> dict:
    return next(v for k, v in pipeline.status(run)["mtp"].items() if k.startswith(f"{name}@"))


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_auto_without_a_verdict_keeps_what_it_measured_faster_and_ignores_a_stale_one(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    """MTP is slower on this engine: the worker measures on, then off, and generates the rest
    of the run with it off; a stale verdict saying on is faster is not followed."""
    pipeline.env["DFLASH_MODEL"] = target_model.name
    _enqueue(pipeline, _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(48)), "slow")
    mine = _decider(pipeline, SLOW_CMD)
    assert mine.identity is not None and mine.key.startswith(mine.hardware + "-")
    stale = dataclasses.replace(mine, identity=EngineIdentity("0" * 12, "0.4.0", "3.10.0"))
    stale_key = _verdict(pipeline, "slow", stale, on=900.0, off=300.0)
    worker = _worker(pipeline, "ws", SLOW_CMD)
    pipeline.wait_done("slow", timeout=400)

    log = _log(pipeline, "ws")
    start = [line for line in log.splitlines() if "] engine starts with mtp " in line]
    assert len(start) == 1 and "mtp on (auto): the target states an MTP head" in start[0] \
        and "this worker's measurement of on, then off" in start[0], start
    area = stale_key.split("/")[3]
    assert f"bench verdict {area} is stale" in log and "ignored" in log
    lines = _choices(pipeline, "ws", "slow")
    assert "measuring mtp on" in lines[0] and "(window 1 of 2" in lines[0], lines
    assert any("measuring mtp off" in line and "(window 2 of 2" in line for line in lines), lines
    found = [m for line in lines if (m := MEASURED.search(line))]
    assert len(found) == 1 and found[0].group(1) == "off", lines
    on, off = (float(found[0].group(i).replace(",", "")) for i in (2, 3))
    assert off > on * 1.05 > 0, (on, off)
    assert not any(": bench " in line for line in lines), lines   # the stale one: never

    record = _record(pipeline, "slow", "ws")
    assert record["source"] == "measured" and record["mtp"] == "off" and record["mode"] == "auto"
    assert record["rates"] == {"on": on, "off": off}, record
    algorithms = [s["engine"].get("speculative_algorithm")
                  for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "slow")]
    assert {"NEXTN", None} == set(algorithms), algorithms   # both were measured on the run
    worker.terminate()
    worker.wait(timeout=60)


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_a_verdict_stored_mid_run_is_followed_from_a_later_shard(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    """MTP is faster here and the worker measures so; a verdict stored afterwards that finds it
    slower is read at a later shard's start and followed (source bench, no rates)."""
    pipeline.env["DFLASH_MODEL"] = target_model.name
    _enqueue(pipeline, _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(80)), "fast")
    worker = _worker(pipeline, "wf", FAST_CMD)
    wait_until(lambda: any(MEASURED.search(line) for line in _choices(pipeline, "wf", "fast")),
               300, "the worker's measured choice")
    measured = next(m for line in _choices(pipeline, "wf", "fast")
                    if (m := MEASURED.search(line)))
    assert measured.group(1) == "on", measured.group(0)
    record = _record(pipeline, "fast", "wf")
    assert record["source"] == "measured" and record["mtp"] == "on"
    assert set(record["rates"]) == {"on", "off"} and record["rates"]["on"] > record["rates"]["off"]
    assert pipeline.read_status("fast")["state"] != "done", "the run ended before the verdict"

    _verdict(pipeline, "fast", _decider(pipeline, FAST_CMD), on=300.0, off=900.0)
    pipeline.wait_done("fast", timeout=400)
    lines = _choices(pipeline, "wf", "fast")
    after = lines[lines.index(next(line for line in lines if MEASURED.search(line))) + 1:]
    assert after and "mtp off (auto): bench " in after[-1] and "at concurrency 4" in after[-1], \
        lines
    held = re.search(r"at (\d+) in flight", after[-1])   # the worker's own load, measured
    assert held and 1 <= int(held.group(1)) <= 4, after[-1]
    record = _record(pipeline, "fast", "wf")
    assert (record["mtp"], record["source"], record["rates"]) == ("off", "bench", None), record
    worker.terminate()
    worker.wait(timeout=60)
