"""Verdicts per turn, against the simulator's server-side request counter: a conversation stops
at its first rejected turn (no request for the turns after it), the turns before it are kept
and train, and the record says which turn stopped it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from common.gates.judge import GateConfig
from common.runs.trainrows import training_rows
from tests.conftest import running_simulator
from tests.test_gates import generate, mt_bench_rows


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Path:
    from embedded.tinymodel import ensure_tiny_model

    return ensure_tiny_model(model_cache)


def three_turn_rows(n: int) -> list[dict[str, Any]]:
    rows = mt_bench_rows(n)
    for row in rows:
        row["turns"].append([{"role": "user", "content": "Now say it in one line."}])
    return rows


def served(url: str) -> int:
    """Requests the server completed, from its own /metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return int(float(re.search(r"^sglang:num_requests_total\S* (\S+)$", text, re.M)[1]))


def run(tiny: Path, rows: list[dict[str, Any]], *flags: str) -> tuple[list[dict], int]:
    from transformers import AutoTokenizer

    from workers.generate.engines.sglang import SglangEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    with running_simulator("--tokenizer", str(tiny), "--time-scale", "0.01", "--len-mu", "4.5",
                           "--len-sigma", "0.3", "--enable-metrics", *flags) as url:
        engine = SglangEngine(url, tokenizer, 16, 30.0, 5.0,
                              [tokenizer.convert_tokens_to_ids("<|im_end|>")])
        samples = generate(engine, tokenizer, rows, gates=GateConfig(min_supervised_tokens=8))
        return samples, served(url)


def test_a_rejected_first_turn_sends_one_request_not_three(tiny: Path) -> None:
    samples, requests = run(tiny, three_turn_rows(4), "--answer-mode", "unclosed")
    assert requests == 4   # one per conversation: turns 2 and 3 were never sent
    for sample in samples:
        quality = sample["quality"]
        assert not quality["passed"] and quality["reasons"] == ["thinking_unclosed"]
        assert quality["turns_passed"] == 0 and len(sample["turns"]) == 1


def test_a_rejected_later_turn_keeps_the_turns_before_it_in_training(tiny: Path) -> None:
    rows = three_turn_rows(24)
    samples, requests = run(tiny, rows, "--answer-mode", "unclosed", "--answer-mode-rate", "0.4")
    cut = [s for s in samples if s["quality"].get("stopped")]
    whole = [s for s in samples if s["quality"]["passed"] and not s["quality"].get("stopped")]
    first = [s for s in samples if not s["quality"]["passed"]]
    assert cut and whole and first, [s["quality"] for s in samples]
    # What the server answered is exactly what the records hold: kept turns plus the rejected.
    assert requests == sum(len(s["turns"]) + bool(s["quality"].get("stopped")) for s in cut) \
        + 3 * len(whole) + len(first)
    for sample in cut:
        quality, stopped = sample["quality"], sample["quality"]["stopped"]
        kept = quality["turns_passed"]
        assert quality["passed"] and stopped["turn"] == kept + 1 and kept in (1, 2)
        assert stopped["reasons"] == ["thinking_unclosed"]
        assert stopped["details"][0].startswith(f"turn {kept + 1}: ")
        assert len(sample["turns"]) == kept and stopped["output_ids"]
        rows_ = training_rows(sample)   # the kept turns train, the rejected one never
        assert [r.turn for r in rows_] == list(range(kept))
        assert rows_[-1].input_ids == sample["turns"][-1]["prompt_ids"] + \
            sample["turns"][-1]["output_ids"]
        answers = [m for m in sample["messages"] if m["role"] == "assistant"]
        assert len(answers) == kept   # the rejected answer is not in the history
