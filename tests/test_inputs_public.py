"""Rows shaped like the public prompt datasets, read by the intake ``enqueue`` runs: no text of
any type dropped, history and tool turns kept, clear reasons, duplicates across files caught.

Small fixtures written here in the datasets' own layouts (JSONL, JSON, ``.jsonl.gz``, Parquet,
``datasets.save_to_disk``); no model is needed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from common.errors import BadRow, ConfigError, InputError
from common.inputs.layouts import normalize_row, template_fields
from tests.conftest import TinyTarget
from tests.test_inputs import config, intake_rows, system, user, write


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


ALPACA_HISTORY = {"instruction": "And in French?", "input": "", "output": "Bonjour",
                  "system": "You translate.", "history": [["Say hi in Spanish.", "Hola"],
                                                          ["And in German?", "Hallo"]]}
GPTEACHER = {"instruction": "Rewrite formally.", "input": "gonna be late", "response": "..."}
SELF_INSTRUCT_USER = {"id": "user_oriented_task_0", "motivation_app": "Grammarly",
                      "instruction": "Fix the grammar.",
                      "instances": [{"input": "me and him goes", "output": "He and I go"}]}
MT_BENCH = {"question_id": 111, "category": "math", "turns": ["Area of a triangle?", "Circle?"],
            "reference": ["Area is 3", "Circle area is 5pi"]}
SHAREGPT = {"id": "QWJhYvA_0", "conversations": [
    {"from": "human", "value": "Summarize rain."}, {"from": "gpt", "value": "Water falls."},
    {"from": "human", "value": "And snow?"}, {"from": "gpt", "value": "Ice falls."}]}
GSM8K = {"question": "Natalia sold 48 clips. How many?", "answer": "72 #### 72"}
HUMANEVAL = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "  return x",
             "test": "assert f(1) == 1", "entry_point": "f"}
WIZARDLM = {"idx": 1, "Skill": "Math", "Difficulty": 3, "Instruction": "What is 7 * 8?"}
ULTRACHAT_STRING = {"id": "9", "data": "What is rain? Rain is water."}
SPECFORGE_TOOLS = {"id": "tool-1", "conversations": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "c2", "content": {"wind": 3}},
    {"role": "assistant", "content": "It is 21 C."},
    {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Welcome."}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}

CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "c1", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULTS = [{"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
           {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "c2"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.mark.parametrize(("row", "layout", "turns", "unused"), [
    (ALPACA_HISTORY, "alpaca", [[system("You translate."), user("Say hi in Spanish.")],
                                [user("And in German?")], [user("And in French?")]], {}),
    (GPTEACHER, "alpaca", [[user("Rewrite formally.\n\ngonna be late")]], {}),
    (SELF_INSTRUCT_USER, "instances", [[user("Fix the grammar.\n\nme and him goes")]],
     {"motivation_app": "Grammarly"}),
    (MT_BENCH, "mt_bench", [[user("Area of a triangle?")], [user("Circle?")]], {}),
    (SHAREGPT, "sharegpt", [[user("Summarize rain.")], [user("And snow?")]], {}),
    (GSM8K, "prompt", [[user("Natalia sold 48 clips. How many?")]], {}),
    (HUMANEVAL, "prompt", [[user("def f(x):\n")]], {"entry_point": "f",
                                                    "test": "assert f(1) == 1"}),
    (WIZARDLM, "alpaca (Instruction as instruction)", [[user("What is 7 * 8?")]], {}),
    (SPECFORGE_TOOLS, "sharegpt", [[user("Weather in Paris?"), CALL, *RESULTS],
                                   [user("Thanks!")]], {}),
])
def test_public_dataset_rows_become_the_expected_turns(tmp_path: Path, row: dict, layout: str,
                                                       turns: list, unused: dict) -> None:
    name = "in.jsonl.gz" if row is HUMANEVAL else "in.jsonl"  # HumanEval ships gzipped
    if row is HUMANEVAL:
        with gzip.open(tmp_path / name, "wt") as handle:
            handle.write(json.dumps(row) + "\n")
    else:
        write(tmp_path / name, [row])
    intake, items = intake_rows(config(str(tmp_path / name)))
    assert [i.error for i in items] == [None]
    assert items[0].row["turns"] == turns
    assert items[0].row.get("tools") == (TOOLS if row is SPECFORGE_TOOLS else None)
    assert intake.layout_summary() == {name: {layout: 1}}
    assert {k: v["example"]["value"] for k, v in intake.unused.items()} == unused
    if unused:  # the same rows are rejected with --strict-fields, naming the fields
        _, strict = intake_rows(config(write(tmp_path / "in.jsonl", [row]), strict_fields=True))
        assert all(name in strict[0].error for name in unused)


def test_text_in_any_type_is_reported_and_rejected_when_strict(tmp_path: Path) -> None:
    rows = [{"id": "f", "question": "First?", "followups": ["second question"]},
            {"id": "m", "question": "Hint?", "meta": {"hint": "think of rivers", "n": 2}},
            {"id": "s", "system": "Be terse.", "messages": [system("Be verbose."), user("Hi")]},
            {"id": "same", "system": "Be terse.", "messages": [system("Be terse."), user("Hi")]},
            {"id": "n", "question": "Numbers only?", "score": 3, "meta": {"n": 2, "t": [" "]}}]
    src = write(tmp_path / "in.jsonl", rows)
    intake, items = intake_rows(config(src))
    assert [i.error for i in items] == [None] * 5
    assert intake.unused == {
        "followups": {"rows": 1, "example": {"file": "in.jsonl", "line": 1,
                                             "value": '["second question"]'}},
        "meta": {"rows": 1, "example": {"file": "in.jsonl", "line": 2,
                                        "value": '{"hint": "think of rivers", "n": 2}'}},
        "system": {"rows": 1, "example": {"file": "in.jsonl", "line": 3, "value": "Be terse."}}}
    assert items[2].row["turns"] == [[system("Be verbose."), user("Hi")]]
    assert items[2].row["source"]["system"] == "Be terse."  # kept beside the row, not lost
    _, strict = intake_rows(config(src, strict_fields=True))
    assert [bool(i.error) for i in strict] == [True, True, True, False, False]
    assert "followups" in strict[0].error and "meta" in strict[1].error
    assert "system" in strict[2].error


def test_templates_name_fields_only(tmp_path: Path) -> None:
    assert template_fields("{instruction}\n\n{context:.20}") == {"instruction", "context"}
    for bad in ("{instruction.__class__}", "{instruction[0]}", "{instruction!r}", "{}", "{0}"):
        with pytest.raises(ConfigError, match="placeholder " + bad.replace("[", r"\[")
                           .replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
            template_fields(bad)
    row = {"question": "Why?", "passage": "Because.", "history": [["Before?", "Yes"]],
           "tags_list": ["a"]}
    result = normalize_row(row, template="{passage}\n\n{question}")
    assert result.conversations[0].turns == [[user("Before?")], [user("Because.\n\nWhy?")]]
    with pytest.raises(Exception, match="field 'tags_list' is a list, not text"):
        normalize_row(row, template="{tags_list} {question}")


def test_detection_messages_and_case_insensitive_fields(tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", [ULTRACHAT_STRING, WIZARDLM,
                                        {"Prompt": "Hi", "prompt": None, "Context": "Extra"}])
    intake, items = intake_rows(config(src))
    assert items[0].error.startswith("data is a string, expected a list of turns")
    assert "--prompt-field data" in items[0].error
    assert items[1].row["turns"] == [[user("What is 7 * 8?")]]
    assert items[2].row["turns"] == [[user("Hi")]]
    assert intake.layout_summary()["in.jsonl"] == {
        "alpaca (Instruction as instruction)": 1,
        "prompt (Prompt as prompt, Context as context)": 1}
    assert intake.unused["context"]["example"]["value"] == "Extra"


def test_a_tool_call_without_its_result_is_an_answer_regenerated(tmp_path: Path) -> None:
    row = {"messages": [user("Weather?"), {"role": "assistant", "tool_calls": [
        {"function": {"name": "w", "arguments": {}}}]}, user("Never mind.")]}
    result = normalize_row(row)
    assert result.conversations[0].turns == [[user("Weather?")], [user("Never mind.")]]
    sharegpt = {"conversations": [{"from": "human", "value": "Sum 2 and 3"},
                                  {"from": "function_call", "value": '{"name": "add"}'},
                                  {"from": "observation", "value": "5"},
                                  {"from": "gpt", "value": "5"}]}
    turns = normalize_row(sharegpt).conversations[0].turns
    call = {"type": "function", "function": {"name": "add", "arguments": {}}}
    assert turns == [[user("Sum 2 and 3"),
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "5"}]]
    for bad, words in (('{"arguments": {}}', "no function name"), ("add(2, 3)", "not JSON")):
        broken = {"conversations": [sharegpt["conversations"][0],
                                    {"from": "function_call", "value": bad},
                                    {"from": "observation", "value": "5"}]}
        with pytest.raises(BadRow, match=words):
            normalize_row(broken)
    with pytest.raises(BadRow, match="arguments is not JSON"):
        normalize_row({"messages": [user("x"), {"role": "assistant", "tool_calls": [
            {"function": {"name": "w", "arguments": "{city"}}]}, {"role": "tool", "content": ""}]})
    with pytest.raises(BadRow, match=r"tools\[0\] is not a function definition"):
        normalize_row({"messages": [user("x")], "tools": [{"description": "nameless"}]})


def test_json_arrays_name_file_lines_and_elements(tmp_path: Path) -> None:
    path = tmp_path / "in.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": ""}, {"prompt": "c"}], indent=1))
    _, items = intake_rows(config(str(path)))
    assert items[1].where == {"line": 5, "element": 2} and "empty" in items[1].error


def test_duplicates_across_files_are_rejected_naming_the_first(tmp_path: Path) -> None:
    rows = [{"instruction": f"Task {i}", "input": ""} for i in range(3)]
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "a.jsonl", rows)
    write(tmp_path / "d" / "b.parquet", [rows[1], {"instruction": "New", "input": ""}])
    with gzip.open(tmp_path / "d" / "c.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    _, items = intake_rows(config(str(tmp_path / "d")))
    errors = [(i.where["file"], i.where["line"], i.error) for i in items if i.error]
    assert [(f, n) for f, n, _ in errors] == [("b.parquet", 1), ("c.jsonl.gz", 1),
                                              ("c.jsonl.gz", 2), ("c.jsonl.gz", 3)]
    assert errors[0][2].startswith("duplicate of a.jsonl line 2")
    assert sum(i.error is None for i in items) == 4


def test_a_parquet_shard_dir_with_history_pairs(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    other = {**ALPACA_HISTORY, "instruction": "And in Italian?", "history": None}
    write(tmp_path / "data" / "train-00000-of-00002.parquet", [ALPACA_HISTORY])
    write(tmp_path / "data" / "train-00001-of-00002.parquet", [other])
    _, items = intake_rows(config(str(tmp_path)))
    assert [len(i.row["turns"]) for i in items] == [3, 1]
    assert items[0].row["turns"][1] == [user("And in German?")]
    assert items[1].row["turns"] == [[system("You translate."), user("And in Italian?")]]


def test_saved_dataset_dict_splits_and_duplicates(tmp_path: Path) -> None:
    import datasets

    train = [{"question": f"Q{i}?", "answer": "A"} for i in range(4)]
    test = [{"question": "Q3?", "answer": "A"}, {"question": "Q9?", "answer": "A"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(
        str(tmp_path / "dd"))
    intake, items = intake_rows(config(str(tmp_path / "dd")))
    assert [i.error is None for i in items] == [True] * 4 + [False, True]
    assert "duplicate of train/" in items[4].error
    assert all(counts == {"prompt": n} for counts, n in
               zip(intake.layout_summary().values(), (4, 2), strict=True))


def test_an_empty_input_is_an_error(tmp_path: Path) -> None:
    for name, body in (("e.jsonl", "\n\n"), ("e.json", "[]")):
        (tmp_path / name).write_text(body)
        with pytest.raises(InputError, match="holds no rows at all"):
            intake_rows(config(str(tmp_path / name)))


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Path:
    from embedded.tinymodel import ensure_tiny_model

    return ensure_tiny_model(model_cache)


def test_tool_turns_render_and_regenerate_on_the_tiny_model(target_model: TinyTarget) -> None:
    from transformers import AutoTokenizer

    from common.gates.judge import GateConfig
    from tests.test_gates import generate
    from workers.generate.engines.cpu import CpuEngine

    tokenizer = AutoTokenizer.from_pretrained(target_model.path)
    row = normalize_row(SPECFORGE_TOOLS).conversations[0].to_json()
    prompt = tokenizer.apply_chat_template(row["turns"][0], tools=row["tools"], tokenize=False,
                                           add_generation_prompt=True)
    tools_json = json.dumps(TOOLS[0])
    results = ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
               '<tool_response>\n{"wind": 3}\n</tool_response><|im_end|>')
    if target_model.hybrid:   # Qwen3.6's dialect: tools preamble first, XML calls
        assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the "
                                 f"following functions:\n\n<tools>\n{tools_json}\n</tools>")
        # after the last user query: the (empty) reasoning block, as Qwen3.6 renders it
        assert ("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
                "<function=get_weather>\n"
                "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>"
                in prompt)
    else:                     # Qwen3's: JSON signatures and JSON calls
        assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more "
                                 "functions")
        assert (f"<tools>\n{tools_json}\n</tools>" in prompt)
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call><|im_end|>' in prompt)
    assert results in prompt
    open_gates = GateConfig(min_supervised_tokens=0, reject_truncated=False,
                            require_thinking=False, reject_empty_answer=False,
                            reject_leakage=False)
    [sample] = generate(CpuEngine(target_model.path, batch_size=1, seed=0), tokenizer, [row],
                        max_new_tokens=8, gates=open_gates)
    roles = [m["role"] for m in sample["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert sample["messages"][1] == CALL  # context, kept as it was
    assert sample["tools"] == TOOLS
    assert len(sample["turns"]) == 2  # two answers generated, the tool call is not one


def test_a_template_without_tool_branches_rejects_tool_rows(tiny: Path) -> None:
    from transformers import AutoTokenizer

    from producer.fit import tool_support

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tool_support(tokenizer) is None
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                               "{% endfor %}")
    assert tool_support(tokenizer) == ("the target's chat template does not render tool "
                                       "definitions, tool calls, call arguments")


def test_a_huge_row_is_judged_too_long_without_tokenizing_it_whole(tiny: Path) -> None:
    from producer.fit import ContextCheck

    check = ContextCheck.for_model(tiny, 256, False)
    assert check is not None
    huge = "island " * (10_000_000 // 7)  # 10 MB
    reason = check({"id": "x", "turns": [[user(huge)]]})
    assert reason and reason.startswith("prompt too long: 9999996 characters cannot fit")
    # Between the character bound and the exact count: the prefix decides, a floor is given.
    long = "island " * 9000
    reason = check({"id": "y", "turns": [[user(long)]]})
    assert reason and "prompt too long: at least" in reason and "context of 4096" in reason
    # A prompt just under the room is counted exactly and accepted, however it is cut.
    assert check({"id": "z", "turns": [[user("island " * 3500)]]}) is None
