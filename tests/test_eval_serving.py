"""eval-drafter --engine sglang end to end on CPU: the simulator serving DFLASH and a plain
baseline, each set at concurrency 1 and 8 (SGLang's spec_accept_length, tokens/s, speedup)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import keys
from common.storage import open_storage
from tests.conftest import Pipeline
from tests.simulator_support import simulator_starter  # noqa: F401  (the start fixture)
from tests.test_eval_sets import GSM8K, MT_BENCH
from tests.test_generate_e2e import _write_jsonl

SIM = ("--time-scale", "0.05", "--len-mu", "3", "--len-sigma", "0.3")


def test_the_serving_engine_at_concurrency_1_and_8(pipeline: Pipeline, tmp_path: Path,
                                                   model_cache: Path, start: Any) -> None:
    from embedded.tinymodel import ensure_tiny_model

    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    pipeline.cli("enqueue", "--input", src, "--run", "srv", "--mode", "online", "--epochs",
                 "1", check=True)
    run = json.loads(open_storage(pipeline.env["DFLASH_STORAGE"]).get(keys.run_config("srv")))
    model = str(ensure_tiny_model(model_cache, run["model"]))
    dflash = start("--tokenizer", model, "--speculative-algorithm", "DFLASH",
                   "--speculative-draft-model-path", str(tmp_path), "--speculative-num-draft-"
                   "tokens", "4", "--accept-length", "2.5", *SIM)
    plain = start("--tokenizer", model, *SIM)
    gsm = _write_jsonl(tmp_path / "test.jsonl", GSM8K)
    base = ("eval-drafter", "--run", "srv", "--engine", "sglang", "--dataset", f"gsm8k={gsm}",
            "--dataset", f"mt-bench={MT_BENCH}", "--num", "3", "--max-new-tokens", "24")
    out = json.loads(pipeline.cli(*base, "--url", dflash.url, "--baseline-url", plain.url,
                                  "--concurrency", "8,1", "--json", check=True).stdout)
    assert out["engine"] == "sglang" and set(out["datasets"]) == {"gsm8k", "mt-bench"}
    for name, row in out["datasets"].items():
        levels = row["concurrency"]
        assert set(levels) == {"1", "8"}, name
        assert row["tau"] is None and row["lossless"] is None and row["prompts"] == 3
        for figures in levels.values():
            # The same greedy replies at each level and on both servers (fixed by the prompt).
            assert figures["tokens"] == row["tokens"] > 3
            assert 1 < figures["spec_accept_length"] <= 4 and figures["spec_verify_ct"] > 0
            assert figures["baseline_tokens_per_s"] > 0 and figures["speedup"] == round(
                figures["tokens_per_s"] / figures["baseline_tokens_per_s"], 4)
        assert (row["tokens_per_s"], row["speedup"]) == (levels["1"]["tokens_per_s"],
                                                         levels["1"]["speedup"])
    assert dflash.call("/sim/stats")[1]["cache_flushes"] >= 8      # before and after warm-up
    text = pipeline.cli(*base, "--url", dflash.url, check=True).stdout   # no baseline: no speedup
    rows = [line.split() for line in text.splitlines() if line.startswith(("gsm8k", "mt-bench"))]
    assert [r[:2] for r in rows[2:]] == [["gsm8k", "1"], ["mt-bench", "1"]]
    assert all(r[3] == "-" and r[4] == "-" for r in rows[2:]), text
    # A server that does not speculate, named as the drafter's: one error line, exit 1.
    wrong = pipeline.cli(*base, "--url", plain.url)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert "answered without spec_accept_length/spec_verify_ct" in wrong.stderr, wrong.stderr
