"""``dflash-pipeline report`` over a synthetic run written straight into local storage."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from common.runs.records import encode_jsonl_zst
from common.storage import LocalStorage
from producer.cli import main
from producer.report import bin_of, build_report, token_stats

RUN = "seed"
GATES = {"min_supervised_tokens": 32, "max_reject_rate": 0.2, "pause_after": 200}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sample(sample_id: str, shard: int, supervised: list[int], thinking: list[int],
           answer: str, reasons: Sequence[str] = (), details: Sequence[str] = (),
           answer_hash: str | None = None, finish: str = "stop") -> dict[str, Any]:
    """A generated-sample record in the workers' format, one assistant turn per token count."""
    messages: list[dict[str, Any]] = []
    turns = []
    for n, (sup, think) in enumerate(zip(supervised, thinking, strict=True)):
        messages += [{"role": "user", "content": f"question {n} of {sample_id}"},
                     {"role": "assistant", "content": f"{answer} (turn {n})",
                      "reasoning_content": "r" * think}]
        turns.append({"prompt_ids": [1, 2, 3], "output_ids": list(range(sup)),
                      "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": sup,
                      "latency_s": 0.1})
    return {
        "id": sample_id, "shard": shard, "messages": messages, "finish_reason": finish,
        "turns": turns, "usage": {"completion_tokens": sum(supervised)},
        "quality": {"passed": not reasons, "reasons": list(reasons), "details": list(details),
                    "supervised_tokens": supervised, "thinking_tokens": thinking,
                    "answer_hash": answer_hash or f"h-{sample_id}"},
    }


def six_token(i: int) -> dict[str, Any]:
    """One of the seed's six-token samples; every tenth is also truncated."""
    truncated = i % 10 == 0
    reasons = ["truncated", "too_few_tokens"] if truncated else ["too_few_tokens"]
    details = (["turn 1: finish_reason length after 6 tokens"] if truncated else []) + [
        "turn 1: 6 supervised tokens < 32"]
    return sample(f"s{i}", 0 if i < 100 else 1, [6], [0], "Sure! " * 60, reasons, details,
                  finish="length" if truncated else "stop")


def put(storage: LocalStorage, key: str, data: Any) -> None:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    assert storage.put_once(key, raw)


def run_json(run: str, **fields: Any) -> dict[str, Any]:
    """A run.json as enqueue writes one (a reader takes no other)."""
    from common.engine.sampling import Sampling
    from common.gates.judge import GateConfig
    from common.runs.records import RunConfig

    config = RunConfig(run=run, model="tiny", input="in.jsonl",
                       sampling=Sampling(**fields.get("sampling", {})),
                       gates=GateConfig.from_json(fields.get("gates", {})))
    return config.to_json()


def write_run(storage: LocalStorage, run: str = RUN) -> None:
    """run.json, manifest and parts: 30 accepted, 170 six-token rejects, 1 duplicate reject."""
    base = f"runs/{run}"
    put(storage, f"{base}/run.json", run_json(run, gates=GATES,
                                              sampling={"max_new_tokens": 64, "thinking": True}))
    put(storage, f"{base}/inputs/_MANIFEST.json", {
        "shards": 2, "rows": 203, "rejected": 2, "shard_rows": [101, 100],
        "examples": [{"line": 7, "reason": "no prompt"}]})
    normal = [sample(f"n{i}", i // 20, [40 + i] * (2 if i < 5 else 1),
                     [100 + i] * (2 if i < 5 else 1), f"Answer number {i}") for i in range(30)]
    gen0 = f"{base}/generated/shard-000000"
    put(storage, f"{gen0}/part-0000.jsonl.zst", encode_jsonl_zst(normal[:15]))
    # A redelivered n0 with different numbers: the first part's copy must win.
    again = sample("n0", 0, [999], [999], "redelivered")
    put(storage, f"{gen0}/part-0001.jsonl.zst", encode_jsonl_zst([again, *normal[15:20]]))
    put(storage, f"{gen0}/_COMMIT.json", {"parts": [0, 1], "samples": 20})
    put(storage, f"{base}/generated/shard-000001/part-0000.jsonl.zst",
        encode_jsonl_zst(normal[20:]))
    rej0, rej1 = f"{base}/rejected/shard-000000", f"{base}/rejected/shard-000001"
    put(storage, f"{rej0}/part-0000.jsonl.zst", encode_jsonl_zst(six_token(i) for i in range(100)))
    # n5 was accepted in generated/: a rejected copy of it must not count.
    leak = sample("n5", 0, [45], [105], "leak", ["template_leakage"], ["turn 1: <|im_end|>"])
    put(storage, f"{rej0}/part-0001.jsonl.zst", encode_jsonl_zst([leak]))
    dup = sample("d0", 1, [50], [90], "Answer number 3 (again)", ["duplicate"],
                 ["same answer as sample n3"], answer_hash="h-n3")
    put(storage, f"{rej1}/part-0000.jsonl.zst",
        encode_jsonl_zst([*(six_token(i) for i in range(100, 170)), dup]))
    empty = sample("s100", 1, [0], [0], "", ["empty_answer"], ["turn 1: empty answer"])
    put(storage, f"{rej1}/part-0001.jsonl.zst", encode_jsonl_zst([empty]))
    put(storage, f"{base}/rejected/input/rows-0000.jsonl", b'{"line": 7}\n')
    put(storage, f"{base}/gates/resume-20240101T000000-0a1b2c.json", {"at": 1.0})
    put(storage, f"{base}/gates/pause-20250101T000000-3d4e5f.json", {
        "reason": "rejection rate 85% > 20% after 200 samples", "at": 2.0, "checked": 200,
        "rejected": 170, "examples": [{"id": "s1", "reasons": ["too_few_tokens"],
                                       "answer": "Sure!"}]})


def cli(storage: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["report", "--storage", str(storage), *args])
    return result


def test_bins_isolate_small_values_then_double() -> None:
    assert [bin_of(v) for v in (0, 6, 15)] == [(0, 1), (6, 7), (15, 16)]
    assert [bin_of(v) for v in (16, 31, 32, 1000)] == [(16, 32), (16, 32), (32, 64), (512, 1024)]
    stats = token_stats(Counter({6: 5, 40: 2, 41: 1}))
    assert stats["histogram"] == [{"lo": 6, "hi": 7, "count": 5}, {"lo": 32, "hi": 64, "count": 3}]
    assert (stats["mode"], stats["mode_count"], stats["p50"], stats["min"], stats["max"]) == \
        (6, 5, 6, 6, 41)
    assert token_stats(Counter())["mode"] is None


def test_json_counts_dedup_spike_and_examples(tmp_path: Path) -> None:
    write_run(LocalStorage(tmp_path))
    result = cli(tmp_path, "--run", RUN, "--json", "--no-png")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples"] == {"total": 201, "accepted": 30, "rejected": 171,
                                 "input_rejected": 2}
    assert report["rejection_rate"] == round(171 / 201, 4)
    assert report["reasons"] == {"too_few_tokens": 170, "truncated": 17, "duplicate": 1}
    sup = report["supervised_tokens"]
    assert (sup["mode"], sup["mode_count"], sup["min"], sup["max"]) == (6, 170, 6, 69)
    assert {"lo": 6, "hi": 7, "count": 170} in sup["histogram"]
    # 35 normal turns (5 two-turn samples) plus the duplicate's one turn, all in [32, 64) or above.
    assert sum(b["count"] for b in sup["histogram"] if b["lo"] >= 32) == 36
    assert report["thinking_tokens"]["mode"] == 0
    assert report["thinking_tokens"]["max"] == 129
    assert report["finish_reasons"] == {"stop": 189, "length": 17}
    assert report["duplicates"] == [{"answer_hash": "h-n3", "count": 2, "ids": ["n3", "d0"]}]
    few = report["examples"]["too_few_tokens"]
    assert [ex["id"] for ex in few] == ["s0", "s1", "s2"]
    assert few[0]["detail"] == few[1]["detail"] == "turn 1: 6 supervised tokens < 32"
    truncated = report["examples"]["truncated"]
    assert [ex["id"] for ex in truncated] == ["s0", "s10", "s20"]
    assert truncated[0]["detail"] == "turn 1: finish_reason length after 6 tokens"
    assert len(few[0]["answer"]) == 200 and few[0]["answer"].startswith("Sure! Sure!")
    assert report["examples"]["duplicate"] == [{"id": "d0", "detail": "same answer as sample n3",
                                                "answer": "Answer number 3 (again) (turn 0)"}]
    assert report["gates"].items() >= GATES.items()   # run.json's gates, as enqueue froze them
    assert report["paused"]["reason"].startswith("rejection rate 85%")
    assert report["png"] is None


def test_png_written_beside_run_and_locally(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    write_run(storage)
    local = tmp_path / "out" / "report.png"
    result = cli(tmp_path / "store", "--run", RUN, "--json", "--png", str(local))
    assert result.exit_code == 0, result.output
    location = json.loads(result.stdout)["png"]
    stored = [k for k in storage.list(f"runs/{RUN}/reports/") if k.endswith(".png")]
    assert len(stored) == 1 and location == f"{storage.root}/{stored[0]}"
    assert stored[0].startswith(f"runs/{RUN}/reports/report-")
    data = storage.get(stored[0])
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert local.read_bytes() == data


def test_text_report_shows_the_key_lines(tmp_path: Path) -> None:
    write_run(LocalStorage(tmp_path))
    result = cli(tmp_path, "--run", RUN)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "201 samples, 30 accepted, 171 rejected by the gates (85.1%)" in out
    assert "PAUSED: rejection rate 85% > 20% after 200 samples" in out
    assert "too_few_tokens" in out and "170" in out
    spike = next(line for line in out.splitlines() if "[6, 7)" in line)
    assert "170" in spike and "<- mode 6" in spike
    assert "thinking tokens per turn: mode 0" in out
    assert "duplicate answer h-n3 x2: n3, d0" in out
    assert "examples of duplicate:" in out
    assert f"PNG: {tmp_path.resolve()}/runs/{RUN}/reports/report-" in out


def test_resume_after_pause_clears_it(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_run(storage)
    assert build_report(storage, RUN)["paused"]["checked"] == 200
    put(storage, f"runs/{RUN}/gates/resume-20250102T000000-6a7b8c.json",
        {"accepted": True, "checked": 200, "max_reject_rate": 0.2, "pause_after": 200,
         "at": 3.0})
    assert build_report(storage, RUN)["paused"] is None


def test_empty_run_prints_zeros(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    put(storage, "runs/fresh/run.json", run_json("fresh"))
    result = cli(tmp_path, "--run", "fresh", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples"] == {"total": 0, "accepted": 0, "rejected": 0, "input_rejected": 0}
    assert report["rejection_rate"] == 0.0 and report["reasons"] == {}
    assert report["supervised_tokens"]["histogram"] == []
    assert report["gates"]["max_reject_rate"] == 0.2   # the defaults run.json froze
    assert storage.get(report["png"].removeprefix(storage.root + "/")).startswith(PNG_MAGIC)
    text = cli(tmp_path, "--run", "fresh", "--no-png")
    assert text.exit_code == 0, text.output
    assert "0 samples, 0 accepted, 0 rejected" in text.stdout
    assert "supervised tokens per turn: no samples yet" in text.stdout


@pytest.mark.parametrize("args", [["--run", "nope"], ["--run", "nope", "--json"]])
def test_unknown_run_exits_1(tmp_path: Path, args: list[str]) -> None:
    write_run(LocalStorage(tmp_path))
    result = cli(tmp_path, *args)
    assert result.exit_code == 1
    assert "run 'nope' not found" in result.stderr
    assert not list(LocalStorage(tmp_path).list("runs/nope/"))
