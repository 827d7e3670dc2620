"""The bench's steady window and the verdict's margin: a rate only while every slot is held, a
winner only by a margin over repeated windows, else the running configuration stays.

The end-to-end tests run ``bench --run`` over MT-Bench's two-turn conversations on the simulator
started through ``--engine-cmd`` (as tests/test_bench_run.py), wrapped to record the argv the
bench launches it with; what is asserted is which rows are steady, how many were in flight in
them, and which configuration wins, never a rate.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from common.runs.bench_verdict import NO_CLEAR, Decider, Verdict
from common.runs.schemas import BENCH_VERDICT
from common.storage import open_storage
from producer.bench import HANDOFF, Sent, steady_row
from producer.bench_run import flush_cache
from tests.conftest import HYBRID, Pipeline, TinyTarget, running_simulator
from tests.test_generate_e2e import _write_jsonl

SIM = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
       "--model-path {model} --max-running 256 --len-mu 5 --len-sigma 1 ")
# At 4 in flight: MTP about 2.5x faster (3.5 tokens a verify step, cheap drafts)...
CLEAR = SIM + "--decode-base-ms 4 --decode-per-req-ms 0.1 --accept-length 3.5"
# ...or the same schedule either way: every draft wrong, verify and drafts free (a tie).
TIE = SIM + "--decode-base-ms 4 --decode-per-req-ms 0 --accept-length 1 --draft-step-ms 0"


def _turns(sent: list[Sent]) -> list[Sent]:
    return sorted(sent, key=lambda s: (s.start, s.end))


def test_the_window_closes_when_fewer_than_the_level_are_in_flight() -> None:
    # Four slots; conversations end, and from 20 s only three are in flight, then one. The old
    # rule (closed at the last request sent, 30 s) took [10, 30] with 3.5 in flight on average.
    first = [Sent(0, 10, 100) for _ in range(4)]
    second = [Sent(10, 20, 100) for _ in range(4)]
    third = [Sent(20, 30, 100) for _ in range(3)] + [Sent(30, 40, 100)]
    row = steady_row(_turns(first + second + third), 4)
    assert row.steady and row.window == (10, 20) and row.in_flight == pytest.approx(4.0)
    assert row.tokens_per_s == pytest.approx(40.0) and len(row.window_rates) == 2
    assert sum(row.window_rates) / 2 == pytest.approx(row.tokens_per_s)
    # A slot handed on a little late (within HANDOFF of a median request) is still held...
    late = [*second[:3], Sent(10 + HANDOFF * 10 / 2, 20, 100)]
    assert steady_row(_turns(first + late + third), 4).window == (10, 20)
    # ...one left empty longer ends the window at once: shorter than a request, not steady...
    empty = [*second[:3], Sent(10 + HANDOFF * 10 * 2, 20, 100)]
    gap = steady_row(_turns(first + empty + third), 4)
    assert not gap.steady and gap.window_rates == () and gap.window == (0, 40)
    # ...unless a request was waiting for the slot all along (the client was slow to send it).
    waited = [*second[:3], Sent(10 + HANDOFF * 10 * 2, 20, 100, ready=1.0)]
    assert steady_row(_turns(first + waited + third), 4).window == (10, 20)


def _rows(rates: dict[str, list[float]], steady: bool = True) -> list[dict]:
    return [{"mtp": mode, "concurrency": 4, "output_tokens_per_s": sum(parts) / len(parts),
             "steady": steady, "window_rates": parts} for mode, parts in rates.items()]


def test_a_winner_needs_the_margin_in_every_window_and_steady_rows() -> None:
    decider = Decider("cpu", 1, "0123abcd")
    clear = Verdict("r", decider, "s", _rows({"on": [120.0, 118.0], "off": [100.0, 101.0]}))
    pick = clear.at(8)
    assert pick is not None and pick.clear and pick.on and pick.follow(False)
    assert clear.winners() == {4: "on"}
    for rates in ({"on": [104.0, 104.0], "off": [100.0, 100.0]},     # within 5%
                  {"on": [140.0, 96.0], "off": [100.0, 100.0]}):     # windows overlap
        tie = Verdict("r", decider, "s", _rows(rates)).at(4)
        assert tie is not None and not tie.clear and NO_CLEAR in tie.line()
        assert tie.follow(True) and not tie.follow(False)   # the running configuration stays
    wide = Verdict("r", decider, "s", _rows({"on": [104.0, 104.0], "off": [100.0, 100.0]}),
                   margin=0.02)
    assert wide.winners() == {4: "on"}
    unsteady = Verdict("r", decider, "s", _rows({"on": [300.0] * 2, "off": [100.0] * 2}, False))
    assert unsteady.at(4) is None and unsteady.winners() == {}
    stored_before = [{k: v for k, v in r.items() if k in ("mtp", "concurrency",
                                                            "output_tokens_per_s")}
                     for r in clear.rows]
    assert Verdict("r", decider, "s", stored_before).at(4) is None


def test_the_simulator_flushes_its_cache_as_sglang_does() -> None:
    with running_simulator("--time-scale", "1") as url:
        flush_cache(url)
        flush_cache(url)
        with urllib.request.urlopen(url + "/sim/stats", timeout=30) as response:
            assert json.loads(response.read())["cache_flushes"] == 2


def _bench(pipeline: Pipeline, cmd: str, argv_log: Path, *args: str) -> dict:
    # sh records the argv, then execs the simulator in its place (signals reach it).
    wrapped = f"sh -c 'echo \"$*\" >> {argv_log}; exec \"$0\" \"$@\"' {cmd} {{engine_args}}"
    result = pipeline.cli("bench", "--run", "talk", "--engine", "sglang", "--engine-cmd",
                          wrapped, "--gpus", "1", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _conversations(n: int) -> list[dict]:
    """``n`` conversations of 1 to 6 turns (as the issue's runs: some end early, some late)."""
    return [{"question_id": i, "category": "bench", "turns": [
        f"Conversation {i}, turn {t}: explain, step by step, why the sky at dusk turns red."
        for t in range(1 + (i * 5) % 6)]} for i in range(n)]


def _stored(pipeline: Pipeline, key: str) -> Verdict:
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    record = BENCH_VERDICT.validate_json(storage.get(key))
    return Verdict("talk", Decider(record["gpu"], record["tp"], record["engine"]),
                   record["stamp"], [dict(r) for r in record["rows"]], record["margin"])


def _flushes(engines: Path) -> list[int]:
    """Each stopped engine's count of cache flushes (the simulator's last stats line)."""
    found = []
    for log in sorted(engines.glob("bench-*.log")):
        for line in log.read_text().splitlines():
            if "stopping: {" in line:
                found.append(ast.literal_eval(line.split("stopping: ", 1)[1])["cache_flushes"])
    return found


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_a_multi_turn_bench_stores_steady_rows_and_follows_only_a_clear_win(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    engines, argv_log = tmp_path / "engines", tmp_path / "argv.log"
    pipeline.env.update(DFLASH_MAX_IN_FLIGHT="4", DFLASH_ENGINE_DIR=str(engines))
    src = _write_jsonl(tmp_path / "in.jsonl", _conversations(24))
    pipeline.cli("enqueue", "--input", src, "--run", "talk", "--model", target_model.name,
                 "--shard-size", "12", "--max-new-tokens", "300", "--max-reject-rate", "1",
                 "--skip-gate", "duplicates", check=True)
    # At 16, conversations end while the longest still send turns: the old rule (to the last
    # request sent) took about 11 in flight as steady. 32 is never held (24 conversations).
    bench = _bench(pipeline, CLEAR, argv_log, "--concurrency", "4,16,32", "--num", "24")
    key = bench["verdict"]["key"]
    assert key is not None, bench["verdict"]
    verdict = _stored(pipeline, key)
    steady = [r for r in verdict.rows if r["steady"]]
    for row in steady:   # a steady window holds its level in flight
        level = row["concurrency"]
        assert 0.9 * level <= row["in_flight_mean"] <= level, row
        assert len(row["window_rates"]) == 2, row
    assert {("off", 4), ("on", 4)} <= {(r["mtp"], r["concurrency"]) for r in steady}
    assert [r for r in verdict.rows if r["concurrency"] == 32 and (r["steady"]
                                                                   or r["window_rates"])] == []
    assert verdict.winners()[4] == "on" and 32 not in verdict.winners()
    assert verdict.margin == 0.05
    pick = verdict.at(4)
    assert pick is not None and pick.concurrency == 4 and pick.clear and pick.follow(False)
    far = verdict.at(32)   # the nearest steady level, never the unsteady 32
    assert far is not None and far.concurrency == max(verdict.steady()) < 32
    # Each engine ran with the workers' own cap and flushed its cache before each level.
    launched = argv_log.read_text().splitlines()
    assert len(launched) == 2 and "--speculative-algorithm" in launched[1], launched
    assert re.search(r"--max-running-requests 4\b", launched[1]), launched[1]
    assert _flushes(engines) == [3, 3]

    tie = _bench(pipeline, TIE, argv_log, "--concurrency", "4", "--num", "24")
    assert NO_CLEAR in tie["verdict"]["note"], tie["verdict"]
    near = _stored(pipeline, tie["verdict"]["key"]).at(4)
    assert near is not None and not near.clear and NO_CLEAR in near.line()
    assert near.follow(True) and not near.follow(False)   # the running configuration stays
