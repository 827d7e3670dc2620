"""eval-drafter --dataset: the standard sets' readers and prompts, and the per-set table on the
tiny target (both tau definitions, by position, lossless)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common import keys
from common.errors import ConfigError, InputError
from common.storage import open_storage
from tests.conftest import Pipeline
from tests.test_generate_e2e import _write_jsonl
from workers.train.drafter.specdec import Decoded
from workers.train.eval_sets import REASON, fetch_set, parse_dataset, read_set
from workers.train.eval_table import by_position, sglang_accept_length

MT_BENCH = Path("/work/shared/data/mt_bench_question.jsonl")
if not MT_BENCH.is_file():   # the repository's copy of the same FastChat file
    from tests.models_cache import MT_BENCH

GSM8K = [{"question": f"Tom has {n} apples. How many now?", "answer": f"#### {n}"}
         for n in range(3)]


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_each_set_is_read_in_its_published_layout_and_built_as_z_lab_builds_it(
        tmp_path: Path) -> None:
    # openai/gsm8k as the hub ships it: main/test-*.parquet beside main/train-*.parquet.
    _parquet(tmp_path / "gsm8k/main/test-00000-of-00001.parquet", GSM8K)
    _parquet(tmp_path / "gsm8k/main/train-00000-of-00001.parquet",
             [{"question": "train only", "answer": "#### 0"}])
    gsm = read_set("gsm8k", str(tmp_path / "gsm8k"), 10)
    assert [p.text for p in gsm] == [r["question"] + REASON for r in GSM8K]
    assert gsm[0].text.endswith("put your final answer within \\boxed{}.")
    math = _write_jsonl(tmp_path / "test.jsonl", [
        {"problem": "What is $1+1$?", "solution": "2", "answer": "2",
         "unique_id": "test/algebra/1.json"}])
    assert [(p.id, p.text) for p in read_set("math500", math, 5)] == [
        ("test/algebra/1.json", "What is $1+1$?" + REASON)]
    human = _write_jsonl(tmp_path / "HumanEval.jsonl", [
        {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f"}])
    [h] = read_set("humaneval", human, 5)
    assert h.id == "HumanEval/0" and h.text == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f(x):\n\n```")
    full = _write_jsonl(tmp_path / "mbpp.jsonl", [
        {"task_id": 11, "text": "Remove a char.", "test_list": ["assert f(1) == 1"]}])
    _parquet(tmp_path / "sanitized/test-00000-of-00001.parquet",
             [{"task_id": 12, "prompt": "Sanitized task.", "test_list": ["assert g()"]}])
    assert [(p.id, p.text) for p in read_set("mbpp", full, 5)] == [("11", "Remove a char.")]
    assert [p.text for p in read_set("mbpp", str(tmp_path / "sanitized"), 5)] == [
        "Sanitized task."]
    mt = read_set("mt-bench", str(MT_BENCH), 3)        # FastChat's question.jsonl: turn one
    first = json.loads(MT_BENCH.read_text().splitlines()[0])
    assert len(mt) == 3 and (mt[0].id, mt[0].text) == (str(first["question_id"]),
                                                      first["turns"][0])
    hub = _write_jsonl(tmp_path / "mt.jsonl", [{"prompt": ["one", "two"], "prompt_id": 7}])
    assert [(p.id, p.text) for p in read_set("mt-bench", hub, 5)] == [("7", "one")]


def test_the_dataset_forms_and_their_refusals(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "hi"}])
    assert (parse_dataset(f"gsm8k={path}").kind, parse_dataset(f"gsm8k={path}").path) == (
        "gsm8k", path)
    assert (parse_dataset("math500").kind, parse_dataset("math500").path) == ("math500", None)
    mine = parse_dataset(path)
    assert (mine.name, mine.kind, mine.path) == ("mine", None, path)
    for bad, words in ((f"gsm9k={path}", "unknown set 'gsm9k'"), ("gsm8k=", "no path"),
                       (str(tmp_path / "none.jsonl"), "neither a standard set")):
        with pytest.raises(ConfigError, match=words):
            parse_dataset(bad)
    # No hub here (and never a network call in a test): one clear error naming NAME=PATH.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"--dataset gsm8k=PATH"):
        fetch_set("gsm8k", tmp_path)
    wrong = _write_jsonl(tmp_path / "wrong.jsonl", [{"text": "not gsm8k"}])
    with pytest.raises(InputError, match=r"wrong.jsonl:1: not a gsm8k row: no text in "
                                         r"'question'"):
        read_set("gsm8k", wrong, 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no JSONL or Parquet file"):
        read_set("gsm8k", str(tmp_path / "empty"), 5)


def test_by_position_and_sglang_accept_length_count_the_prefill_token() -> None:
    # Steps start at generation token 1 (the prefill's token is token 0): 1, 5, ..., 1021
    # (the 3), then 1024 (the 2) and 1026 (the 6), past the 1k line.
    long = Decoded(tokens=[0] * 1032, target_forwards=259, accepted=[4] * 255 + [3, 2, 6])
    short = Decoded(tokens=[0] * 7, target_forwards=3, accepted=[4, 2])
    assert by_position([long, short]) == {"0-1k": round((4 * 255 + 3 + 4 + 2) / 258, 4),
                                          "1k-4k": 4.0, "4k-16k": None, "16k+": None}
    assert sglang_accept_length([long, short]) == round((1032 / 258 + 7 / 2) / 2, 4)
    assert sglang_accept_length([Decoded([5], 1)]) is None      # no verify step, as SGLang


def test_eval_drafter_on_the_standard_sets(pipeline: Pipeline, tmp_path: Path,
                                           model_cache: Path) -> None:
    """The tiny target: per-set tau, tau_pooled, by_position and lossless; a bad file is one
    error line, exit 1; without --dataset the JSON keeps today's keys."""
    from embedded.tinymodel import ensure_tiny_model
    from workers.train.drafter.export import export_drafter
    from workers.train.drafter.model import DFlashDraftModel, add_mask_token
    from workers.train.drafter.target_loader import load_target

    src = _write_jsonl(tmp_path / "in.jsonl",
                       [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:4]])
    pipeline.cli("enqueue", "--input", src, "--run", "sets", "--mode", "online", "--epochs",
                 "1", check=True)
    run = json.loads(open_storage(pipeline.env["DFLASH_STORAGE"]).get(keys.run_config("sets")))
    target, tokenizer = load_target(ensure_tiny_model(model_cache, run["model"]))
    drafter = DFlashDraftModel.for_target(target, add_mask_token(tokenizer, target),
                                          layer_ids=run["target_layer_ids"], init_seed=1)
    export = str(export_drafter(drafter, tmp_path / "drafter"))
    gsm = _write_jsonl(tmp_path / "test.jsonl", GSM8K)
    base = ("eval-drafter", "--run", "sets", "--drafter", export, "--num", "2",
            "--max-new-tokens", "16", "--block-size", "4")
    out = json.loads(pipeline.cli(*base, "--dataset", f"gsm8k={gsm}", "--dataset",
                                  f"mt-bench={MT_BENCH}", "--no-thinking", "--json",
                                  check=True).stdout)
    assert set(out["datasets"]) == {"gsm8k", "mt-bench"} and out["thinking"] == "off"
    assert {"tau", "tau_pooled", "spec_accept_length", "by_position"} <= set(out["definition"])
    for row in out["datasets"].values():
        assert row["prompts"] == 2 and row["lossless"] == {"checked": 2, "mismatches": []}
        assert 1 <= row["tau"] <= 4 and 1 <= row["tau_pooled"] <= 4
        # 16 tokens: every step starts below 1k, so that bucket is the pooled tau.
        assert row["by_position"] == {"0-1k": row["tau_pooled"], "1k-4k": None,
                                      "4k-16k": None, "16k+": None}
        assert row["spec_accept_length"] > row["tau_pooled"] - 1e-4   # + the prefill token
        assert row["tokens_per_s"] is None and row["concurrency"] is None
    text = pipeline.cli(*base, "--dataset", f"gsm8k={gsm}", "--num", "1", check=True).stdout
    assert text.splitlines()[0].split()[:3] == ["set", "prompts", "tokens"]
    assert text.splitlines()[1].startswith("gsm8k") and "1/1" in text.splitlines()[1]

    bad = pipeline.cli(*base, "--dataset", f"gsm8k={src}")       # mt-bench rows, not gsm8k's
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("error:")] == [
        line for line in bad.stderr.splitlines() if "not a gsm8k row" in line] != []

    plain = json.loads(pipeline.cli("eval-drafter", "--run", "sets", "--drafter", export,
                                    "--prompts", src, "--num", "1", "--max-new-tokens", "8",
                                    "--json", check=True).stdout)
    assert set(plain) == {"run", "step", "drafter", "source", "max_new_tokens", "device",
                          "block_size", "prompts", "tokens", "steps", "tau", "tau_pooled",
                          "accepted_hist", "per_position", "target_forwards_per_token",
                          "lossless", "seconds", "greedy_seconds"}
