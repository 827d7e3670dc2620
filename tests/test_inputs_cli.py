"""``enqueue`` on real inputs: many files, globs, S3 prefixes, unused fields, ``--dry-run``.

Real ``redis-server``, moto's S3 server, the CLI as a subprocess and the tiny model's tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import keys
from common.runs.records import decode_jsonl_zst
from common.storage import open_storage
from tests.conftest import AWS_ENV, ROOT, RedisServer
from tests.test_inputs import shards, write

pytestmark = pytest.mark.e2e


@pytest.fixture
def env(redis_server: RedisServer, model_cache: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "DFLASH_BROKER_URL": redis_server.url,
            "DFLASH_STORAGE": str(tmp_path / "storage"), "DFLASH_CACHE_DIR": str(model_cache)}


def enqueue(env: dict[str, str], run: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--run", run, *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def queued_ids(env: dict[str, str], run: str) -> list[str]:
    storage = open_storage(env["DFLASH_STORAGE"])
    return [row["id"] for key in sorted(storage.list(keys.inputs_prefix(run)))
            if key.endswith(".jsonl.zst") for row in decode_jsonl_zst(storage.get(key))]


def test_many_files_each_way_enqueue_their_union_once(env, tmp_path: Path, s3_endpoint: str,
                                                      redis_server: RedisServer) -> None:
    import boto3

    rows = shards(tmp_path)
    data = tmp_path / "ds" / "data"
    files = sorted(data.iterdir())
    aws = {**AWS_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, **{
        "aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"})
    s3.create_bucket(Bucket="inputs")
    for path in files:
        s3.upload_file(str(path), "inputs", f"prompts/{path.name}")
    ways = {
        "dir": ["--input", str(tmp_path / "ds")],
        "glob": ["--input", str(data / "train-*.parquet")],
        "two": ["--input", str(files[0]), "--input", str(data / "train-0000[12]-*.parquet")],
        "s3": ["--input", "s3://inputs/prompts/"],
        "s3glob": ["--input", "s3://inputs/prompts/train-*-of-00003.parquet"],
    }
    for run, args in ways.items():
        first = enqueue({**env, **aws}, run, *args, "--shard-size", "5", "--json")
        assert first.returncode == 0, first.stderr
        ids = queued_ids(env, run)
        assert len(ids) == len(set(ids)) == len(rows), (run, ids)
        assert sorted(i.rsplit("/", 1)[1] for i in ids) == sorted(str(r["id"]) for r in rows)
        assert json.loads(first.stdout)["enqueued"] == 3
        before = sorted(open_storage(env["DFLASH_STORAGE"]).list(f"runs/{run}/"))
        again = enqueue({**env, **aws}, run, *args, "--shard-size", "5", "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["enqueued"] == 0, run
        assert sorted(open_storage(env["DFLASH_STORAGE"]).list(f"runs/{run}/")) == before
    # Every way names the same rows by the same file-qualified ids.
    assert queued_ids(env, "dir") != queued_ids(env, "glob")  # relative to what was named
    assert queued_ids(env, "glob") == queued_ids(env, "two") == queued_ids(env, "s3") == \
        queued_ids(env, "s3glob")


def test_unused_field_is_reported_and_strict_fields_rejects(env, tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", [{"id": "a", "question": "Why is the sky blue?"},
                                        {"id": "b", "question": "Who wrote it?",
                                         "passage": "Hamlet is a tragedy."}])
    loose = enqueue(env, "loose", "--input", src)
    assert loose.returncode == 0, loose.stderr
    assert "unused text field 'passage' in 1 rows" in loose.stdout
    strict = enqueue(env, "strict", "--input", src, "--strict-fields")
    assert strict.returncode == 3, strict.stderr
    assert "line 2: text field(s) passage would be dropped" in strict.stdout
    assert queued_ids(env, "strict") == ["a"]


def test_dry_run_renders_rows_and_writes_nothing(env, tmp_path: Path,
                                                 redis_server: RedisServer) -> None:
    from tests.test_inputs import DOLLY, INSTANCES

    src = write(tmp_path / "in.parquet", [DOLLY, INSTANCES, {"id": "x", "prompt": "Hello"}])
    result = enqueue(env, "dry", "--input", src, "--dry-run", "--show", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("--- ") == 3 and "prompt tokens" in out
    assert "<|im_start|>user\nSummarize.\n\nThe Nile is 6,650 km long.<|im_end|>" in out
    assert "Night : Day :: Right : Left" in out and "dolly 1" in out and "instances 1" in out
    assert "4 rows read, 4 good, 0 rejected" in out
    assert not (tmp_path / "storage").exists(), "a dry run wrote to storage"
    assert redis_server.client().dbsize() == 0, "a dry run touched Redis"
    report = json.loads(enqueue(env, "dry", "--input", src, "--dry-run", "--json").stdout)
    assert report["rows"] == 4 and len(report["shown"]) == 3


def test_empty_inputs_and_bad_templates_fail_with_one_line(env, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    result = enqueue(env, "empty", "--input", str(tmp_path / "empty.jsonl"))
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no rows at all" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not list(open_storage(env["DFLASH_STORAGE"]).list("runs/empty/")), "a run was made"
    src = write(tmp_path / "in.jsonl", [{"instruction": "Hi"}])
    result = enqueue(env, "tmpl", "--input", src, "--prompt-template", "{instruction.__class__}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "placeholder {instruction.__class__} is not allowed" in result.stderr


@pytest.mark.parametrize("args, words", [
    (("--top-k", "0"), "--top-k 0: must be -1 (off) or at least 1"),
    (("--top-p", "1.5"), "1.5"),          # click's own range check: exit 2 as well
    (("--top-k", "-1", "--temperature", "0", "--max-new-tokens", "0"), "--max-new-tokens"),
])
def test_sampling_sglang_refuses_is_one_error_line_exit_2(env, tmp_path: Path, args: tuple,
                                                          words: str) -> None:
    src = write(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    for extra in ((), ("--dry-run",)):
        result = enqueue(env, "bad", "--input", src, *args, *extra)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
    assert not list(open_storage(env["DFLASH_STORAGE"]).list("runs/bad/")), "a run was made"
    # Greedy decoding takes any top-k: SGLang replaces it with 1.
    greedy = enqueue(env, "greedy", "--input", src, "--top-k", "0", "--temperature", "0",
                     "--dry-run")
    assert greedy.returncode == 0, greedy.stderr


def test_dry_run_reports_what_the_real_run_does(env, tmp_path: Path) -> None:
    bad = [{"id": f"b{i}", "question": "Q?", "followups": [f"then {i}?"]} for i in range(24)]
    good = [{"question_id": 1, "turns": ["First question?", "Second question?"]}]
    src = write(tmp_path / "in.jsonl", [*good, *bad, {"question": ""}])
    args = ["--input", src, "--strict-fields"]
    dry = enqueue(env, "same", *args, "--dry-run", "--show", "1")
    real = enqueue(env, "same", *args)
    assert dry.returncode == real.returncode == 3, (dry.stderr, real.stderr)

    def rejected(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith("  line ")
                or line.startswith("  ... and")]

    assert rejected(dry.stdout) == rejected(real.stdout)
    assert len(rejected(dry.stdout)) == 21 and rejected(dry.stdout)[-1] == "  ... and 5 more"
    assert "followups would be dropped" in rejected(dry.stdout)[0]
    assert "turn 2: " in dry.stdout and "Second question?" in dry.stdout
    report = json.loads(enqueue(env, "same", *args, "--dry-run", "--json").stdout)
    [shown] = report["shown"]
    assert [t["turn"] for t in shown["turn_prompts"]] == [1, 2]
    assert "Second question?" in shown["turn_prompts"][1]["prompt"]
    assert "[the model's answer to turn 1]" in shown["turn_prompts"][1]["prompt"]


def test_chat_template_kwargs_reach_every_render_and_are_frozen(env, tmp_path: Path,
                                                                model_cache: Path) -> None:
    import shutil

    from common.runs.store import RunStore
    from embedded.tinymodel import ensure_tiny_model
    from producer.fit import ContextCheck

    # A copy of the target whose template reads an option, as Qwen3.6's reads preserve_thinking.
    model = tmp_path / "target"
    shutil.copytree(ensure_tiny_model(model_cache), model)
    template = (model / "chat_template.jinja") if (model / "chat_template.jinja").is_file() \
        else None
    config = json.loads((model / "tokenizer_config.json").read_text())
    text = template.read_text() if template else config["chat_template"]
    marked = "{%- if shout is defined and shout %}{{- 'SHOUT ' }}{%- endif %}" + text
    if template:
        template.write_text(marked)
    else:
        config["chat_template"] = marked
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    env = {**env, "DFLASH_MODEL": str(model)}
    src = write(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    shown = json.loads(enqueue(env, "kw", "--input", src, "--dry-run", "--json",
                               "--chat-template-kwargs", '{"shout": true}').stdout)["shown"]
    assert shown[0]["prompt"].startswith("SHOUT ")
    plain = json.loads(enqueue(env, "kw", "--input", src, "--dry-run", "--json").stdout)
    assert not plain["shown"][0]["prompt"].startswith("SHOUT ")
    assert enqueue(env, "kw", "--input", src, "--chat-template-kwargs",
                   '{"shout": true}').returncode == 0
    stored = RunStore(open_storage(env["DFLASH_STORAGE"]), "kw").config()
    assert stored.chat_template_kwargs == {"shout": True}
    check = ContextCheck.for_model(model, 16, True, stored.chat_template_kwargs)
    assert check is not None and check.template_kwargs == {"shout": True}
    again = enqueue(env, "kw", "--input", src, "--chat-template-kwargs", '{"shout": false}')
    assert again.returncode == 4 and "chat_template_kwargs.shout" in again.stderr
    for bad, words in (("[1]", "must be a JSON object"), ("{nope", "not JSON"),
                       ('{"enable_thinking": false}', "--thinking on|off|mix:R")):
        result = enqueue(env, "kw2", "--input", src, "--chat-template-kwargs", bad)
        assert result.returncode == 2 and words in result.stderr, result.stderr


def test_sampling_comes_from_the_targets_generation_config_and_flags_override(
        env, tmp_path: Path, model_cache: Path) -> None:
    import shutil

    from common.runs.store import RunStore
    from embedded.tinymodel import ensure_tiny_model

    model = tmp_path / "target"
    shutil.copytree(ensure_tiny_model(model_cache), model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 40,
         "eos_token_id": [2, 0]}))
    env = {**env, "DFLASH_MODEL": str(model)}
    src = write(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    dry = json.loads(enqueue(env, "gc", "--input", src, "--dry-run", "--json").stdout)
    assert dry["sampling"]["temperature"] == {"value": 1.0, "source": "generation_config.json"}
    assert dry["sampling"]["top_p"] == {"value": 0.95, "source": "generation_config.json"}
    assert dry["sampling"]["top_k"] == {"value": 40, "source": "generation_config.json"}
    assert dry["sampling"]["min_p"] == {"value": 0.0, "source": "default"}
    text = enqueue(env, "gc", "--input", src, "--dry-run").stdout
    assert "temperature 1.0 (generation_config.json)" in text
    real = enqueue(env, "gc", "--input", src, "--top-p", "0.8")
    assert real.returncode == 0, real.stderr
    assert "top_p 0.8 (flag)" in real.stdout and "temperature 1.0 (generation_config.json)" \
        in real.stdout
    config = RunStore(open_storage(env["DFLASH_STORAGE"]), "gc").config()
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == \
        (1.0, 0.8, 40)
    assert config.sampling_sources["top_p"] == "flag"
    # A target that asks for greedy decoding gets it unless a flag says otherwise.
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    greedy = json.loads(enqueue(env, "gr", "--input", src, "--dry-run", "--json").stdout)
    assert greedy["sampling"]["temperature"]["value"] == 0.0


def test_thinking_modes_are_frozen_and_max_new_tokens_comes_from_the_context(
        env, tmp_path: Path) -> None:
    from common.runs.store import RunStore

    src = write(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Question {i}?"}
                                        for i in range(40)])
    dry = json.loads(enqueue(env, "mx", "--input", src, "--dry-run", "--json", "--show", "40",
                             "--thinking", "mix:0.5").stdout)
    # The tiny target's context is 4096: the budget it allows, below the 32,768 cap.
    assert dry["sampling"]["max_new_tokens"] == {"value": 4096, "source": "target context"}
    assert dry["sampling"]["thinking_off_share"]["value"] == 0.5
    modes = [row["thinking"] for row in dry["shown"]]
    assert 8 <= modes.count(False) <= 32 and True in modes   # a stable share, chosen by id
    for row in dry["shown"]:
        closed = row["prompt"].endswith("<think>\n\n</think>\n\n")
        assert closed == (not row["thinking"]), row["prompt"][-40:]
    again = json.loads(enqueue(env, "mx", "--input", src, "--dry-run", "--json", "--show", "40",
                               "--thinking", "mix:0.5").stdout)
    assert [row["thinking"] for row in again["shown"]] == modes
    assert enqueue(env, "mx", "--input", src, "--thinking", "mix:0.5").returncode == 0
    config = RunStore(open_storage(env["DFLASH_STORAGE"]), "mx").config()
    assert (config.sampling.thinking, config.sampling.thinking_off_share) == (True, 0.5)
    assert config.sampling.max_new_tokens == 4096
    changed = enqueue(env, "mx", "--input", src, "--thinking", "on")
    assert changed.returncode == 4 and "sampling.thinking_off_share" in changed.stderr
    off = json.loads(enqueue(env, "off", "--input", src, "--dry-run", "--json",
                             "--no-thinking", "--max-new-tokens", "64").stdout)
    assert off["sampling"]["thinking"]["value"] is False
    assert off["sampling"]["max_new_tokens"] == {"value": 64, "source": "flag"}
    for bad in ("mix:2", "sometimes", "mix:x"):
        result = enqueue(env, "bad", "--input", src, "--thinking", bad)
        assert result.returncode == 2 and "--thinking" in result.stderr, result.stderr


def test_tool_rows_are_rejected_when_the_template_cannot_render_tools(
        env, tmp_path: Path, model_cache: Path) -> None:
    import shutil

    from embedded.tinymodel import ensure_tiny_model

    model = tmp_path / "target"
    shutil.copytree(ensure_tiny_model(model_cache), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                               "<|im_start|>assistant\n{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    rows = [{"id": "plain", "prompt": "Hi"},
            {"id": "tools", "tools": [tool], "messages": [{"role": "user", "content": "2+3?"}]}]
    src = write(tmp_path / "in.jsonl", rows)
    for target in (None, str(model)):
        run_env = {**env, **({"DFLASH_MODEL": target} if target else {})}
        report = json.loads(enqueue(run_env, f"t{bool(target)}", "--input", src, "--dry-run",
                                    "--json").stdout)
        if target is None:   # the tiny target's template renders tools: both rows go on
            assert report["rejected"] == 0, report
            continue
        assert report["rejected"] == 1, report
        assert "does not render tool definitions, tool calls, call arguments" in \
            report["examples"][0]["reason"]
