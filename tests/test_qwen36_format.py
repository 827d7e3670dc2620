"""Qwen3.6's conversation format end to end on the hybrid (tiny-qwen3.5, whose template behaves
as Qwen3.5/3.6's): multi-turn and tool-use rows, ``--thinking mix:0.5`` and
``preserve_thinking``, through real Redis, a real worker, moto's S3 and the simulator serving
the hybrid's tokenizer. Every stored turn's prompt is the target's own template applied to the
conversation rebuilt from the stored records; the exports carry reasoning apart from content
and re-render to the stored prompt."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from common.inputs.layouts import normalize_row
from tests.conftest import HYBRID, Pipeline, TinyTarget
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl

pytestmark = pytest.mark.e2e

SIM_CMD = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           "--model-path {model} --time-scale 0.05 --len-mu 4.8 --len-sigma 0.3")
KWARGS = {"preserve_thinking": True}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def tool_rows(n: int) -> list[dict[str, Any]]:
    """OpenAI-layout tool-use rows: a call and its result as context, then a follow-up turn."""
    cities = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito"]
    return [{"id": f"tool-{i}", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps({"temp": 20 + i})},
        {"role": "assistant", "content": "It is mild."},
        {"role": "user", "content": "Should I take a coat?"}]}
        for i, city in enumerate(cities[:n])]


def prompt_ids(tokenizer: Any, messages: list[dict], tools: list | None, thinking: bool) -> list:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True, enable_thinking=thinking,
                                         **KWARGS)
    return tokenizer.encode(text, add_special_tokens=False)


def generated_positions(messages: list[dict]) -> list[int]:
    """Where the regenerated answers are: assistant messages that are not tool-call context."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"
            and not m.get("tool_calls")]


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_qwen36_turns_rebuild_from_the_records_and_the_exports(
        pipeline: Pipeline, tmp_path: Path, target_model: TinyTarget) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_model.path)
    rows = _mt_bench_rows(10) + tool_rows(6)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    pipeline.env["DFLASH_MODEL"] = target_model.name
    pipeline.cli("enqueue", "--input", src, "--run", "q36", "--shard-size", "4",
                 "--thinking", "mix:0.5", "--chat-template-kwargs", json.dumps(KWARGS),
                 "--max-new-tokens", "600", "--min-supervised-tokens", "4",
                 "--max-reject-rate", "1", "--skip-gate", "duplicates", check=True)
    run_json = json.loads(pipeline.cli("enqueue", "--input", src, "--run", "q36-dry",
                                       "--thinking", "mix:0.5", "--dry-run", "--json",
                                       check=True).stdout)
    assert run_json["sampling"]["thinking_off_share"]["value"] == 0.5
    pipeline.start_worker("w1", "--engine", "sglang", "--engine-cmd", SIM_CMD,
                          "--max-in-flight", "16")
    pipeline.wait_done("q36", timeout=300)

    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], "q36")
    assert len(samples) == len(rows)
    modes = {s["thinking"] for s in samples}
    assert modes == {True, False}, "mix:0.5 over 16 ids renders both modes"
    inputs = {c.id: c.turns for row in rows for c in normalize_row(row).conversations[:1]}
    turns_checked = 0
    for sample in samples:
        messages, tools = sample["messages"], sample.get("tools")
        for message in messages:   # reasoning never inside content
            assert "<think>" not in (message.get("content") or "")
            assert "</think>" not in (message.get("content") or "")
        for turn, at in zip(sample["turns"], generated_positions(messages), strict=False):
            assert turn["prompt_ids"] == prompt_ids(tokenizer, messages[:at], tools,
                                                    sample["thinking"]), sample["id"]
            text = tokenizer.decode(turn["prompt_ids"])
            ending = "<think>\n" if sample["thinking"] else "<think>\n\n</think>\n\n"
            assert text.endswith(f"<|im_start|>assistant\n{ending}")
            if tools:
                assert "<function=get_weather>\n<parameter=city>\n" in text
                assert '"name": "get_weather"' in text.split("</tools>")[0]
            turns_checked += 1
        stopped = sample["quality"].get("stopped")
        if stopped and sample["turns"]:   # its prompt: the kept history and its own input
            asked = inputs[sample["id"]][stopped["turn"] - 1]
            assert messages[-1]["role"] == "assistant", "the record ends on its last kept answer"
            assert stopped["prompt_ids"] == prompt_ids(tokenizer, messages + asked, tools,
                                                       sample["thinking"])
    assert turns_checked >= len(rows)
    # preserve_thinking reached generation: a second turn's prompt shows the first's reasoning.
    reasoned = [s for s in samples if s["thinking"] and len(s["turns"]) == 2
                and s["messages"][generated_positions(s["messages"])[0]]["reasoning_content"]]
    assert reasoned
    first = reasoned[0]["messages"][generated_positions(reasoned[0]["messages"])[0]]
    assert first["reasoning_content"] in tokenizer.decode(reasoned[0]["turns"][1]["prompt_ids"])

    status = pipeline.status("q36")["gates"]
    assert status["thinking"] == {"on": sum(s["thinking"] for s in samples),
                                  "off": sum(not s["thinking"] for s in samples)}
    assert status["turns"]["judged"] >= turns_checked

    for fmt in ("messages", "specforge"):
        out = tmp_path / f"export-{fmt}"
        pipeline.cli("export-dataset", "--run", "q36", "--format", fmt, "--out", str(out),
                     check=True)
        exported = [json.loads(line) for f in sorted(out.rglob("*.jsonl"))
                    for line in f.read_text().splitlines() if line.strip()]
        assert exported
        by_id = {s["id"]: s for s in samples}
        key = "messages" if fmt == "messages" else "conversations"
        for row in exported:
            sample = by_id[row["id"]]
            answers = [m for m in row[key] if m["role"] == "assistant" and not m.get("tool_calls")]
            assert all("</think>" not in m["content"] for m in answers)
            if sample["thinking"]:
                assert any(m.get("reasoning_content") for m in answers), row
            if sample.get("tools"):
                assert row["tools"] == sample["tools"]
                assert any(m.get("tool_calls") for m in row[key])
            # Re-rendering the row with the target's template gives its last turn's prompt.
            last = generated_positions(row[key])[-1]
            assert prompt_ids(tokenizer, row[key][:last], row.get("tools"), row["thinking"]) \
                == sample["turns"][-1]["prompt_ids"], row["id"]
