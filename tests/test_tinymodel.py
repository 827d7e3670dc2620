"""Acceptance tests for the embedded CPU models (:mod:`embedded.tinymodel`), both targets.

Run: ``.venv/bin/python -m pytest tests/test_tinymodel.py -q -s``. The models come from the
session ``model_cache`` (built once before the first test, a few minutes on two cores, then
reused across runs); the concurrency test builds one more dense copy in a fresh directory, with
a short training run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.engine.target import TargetShape
from embedded.tinymodel import READY_MARKER, TINY_MODEL_VERSION, ensure_tiny_model
from tests.conftest import TinyTarget

ROOT = Path(__file__).resolve().parent.parent
MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


@pytest.fixture(scope="session")
def tiny_path(target_model: TinyTarget) -> Path:
    return target_model.path


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> tuple:
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    model.eval()
    return tok, model


def test_loads_offline_with_single_token_specials(tiny_path: Path) -> None:
    # A fresh interpreter with the hub switched off proves nothing is fetched or cached in-process.
    script = textwrap.dedent(
        f"""
        import json
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(tiny_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tiny_path)!r})
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        print(json.dumps({{
            "ids": {{t: tok.encode(t, add_special_tokens=False) for t in specials}},
            "eos": tok.eos_token, "pad": tok.pad_token, "vocab": len(tok),
            "model_eos": model.config.eos_token_id, "model_pad": model.config.pad_token_id,
            "gen_eos": model.generation_config.eos_token_id,
            "model_vocab": model.config.vocab_size,
        }}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(len(ids) == 1 for ids in info["ids"].values()), info["ids"]
    im_end, endoftext = info["ids"]["<|im_end|>"][0], info["ids"]["<|endoftext|>"][0]
    assert (info["eos"], info["pad"]) == ("<|im_end|>", "<|endoftext|>")
    assert (info["model_eos"], info["model_pad"]) == (im_end, endoftext)
    assert info["gen_eos"] == [im_end, endoftext]
    assert 4000 <= info["vocab"] <= 8000 and info["model_vocab"] >= info["vocab"]
    config = json.loads((tiny_path / "tokenizer_config.json").read_text())
    assert "<think>" in config["chat_template"]
    assert (tiny_path / "model.safetensors").is_file()
    assert (tiny_path / READY_MARKER).is_file()


def test_chat_template_matches_its_family(tiny: tuple, target_model: TinyTarget) -> None:
    """Qwen3's template on the dense target; Qwen3.5/3.6's behaviour on the hybrid: the
    generation prompt opens the think block, and preserve_thinking keeps earlier reasoning."""
    tok, _ = tiny

    def render(messages: list[dict], **kwargs: object) -> str:
        return tok.apply_chat_template(messages, tokenize=False, **kwargs)

    single = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
    gen = "<|im_start|>assistant\n" + ("<think>\n" if target_model.hybrid else "")
    assert render(single, add_generation_prompt=True, enable_thinking=True) == prompt + gen
    assert render(single, add_generation_prompt=True) == prompt + gen
    assert (
        render(single, add_generation_prompt=True, enable_thinking=False)
        == prompt + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )

    answered = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
    ]
    assert render(answered) == (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n"
    )
    # Reasoning of turns before the last user message is dropped, given either way.
    for earlier in (answered[1], {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"}):
        two = [answered[0], earlier, {"role": "user", "content": "Q2"}]
        assert render(two, add_generation_prompt=True, enable_thinking=True) == (
            "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
            "<|im_start|>user\nQ2<|im_end|>\n" + gen
        )
        kept = render(two, add_generation_prompt=True, preserve_thinking=True)
        assert ("<think>\nR1\n</think>\n\nA1" in kept) == target_model.hybrid
    specials = [t for t in ("<think>", "</think>", "<tool_call>", "</tool_call>",
                            "<tool_response>", "</tool_response>") if t in tok.get_vocab()]
    expected = 6 if target_model.hybrid else 2   # Qwen3.6's tokenizer holds the tool markers
    assert len(specials) == expected, specials


def _generate(tok, model, conversations: list[list[dict]], seed: int) -> list[dict]:
    """Sample one reply per conversation the way the pipeline does; parse its structure."""
    prompts = [
        tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, enable_thinking=True)
        for c in conversations
    ]
    opened = "<think>\n" if prompts[0].endswith("<think>\n") else ""  # Qwen3.6 opens it
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **batch, do_sample=True, temperature=0.7, top_p=0.95, max_new_tokens=160
        )
    replies = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        text = opened + tok.decode(row)
        body = text.split("<|im_end|>")[0]
        answer = body.split("</think>")[-1].strip()
        ok = (
            tok.eos_token_id in row
            and body.startswith("<think>\n")
            and body.count("</think>") == 1
            and bool(answer)
        )
        replies.append({"ok": ok, "text": text, "answer": answer, "tokens": len(row)})
    return replies


def test_generation_follows_think_answer_structure(tiny: tuple, target_model: TinyTarget
                                                   ) -> None:
    tok, model = tiny
    # The hybrid decodes through torch's Gated DeltaNet fallback, several times slower: half
    # the prompts, the same pass rates.
    n = 8 if target_model.hybrid else 16
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:n]]
    first = [[{"role": "user", "content": r["turns"][0]}] for r in rows]
    replies = _generate(tok, model, first, seed=0)
    passed = sum(r["ok"] for r in replies)
    print(f"\n{target_model.name} turn 1: {passed}/{n} well-formed; sample: "
          f"{replies[0]['text']!r}")
    for r in replies:
        if not r["ok"]:
            print(f"  malformed: {r['text']!r}")
    assert passed >= n - n // 8

    second = [
        conv + [{"role": "assistant", "content": r["answer"]}, {"role": "user", "content": q}]
        for conv, r, q in zip(first, replies, (r["turns"][1] for r in rows), strict=True)
    ][: n // 2]
    replies2 = _generate(tok, model, second, seed=1)
    passed2 = sum(r["ok"] for r in replies2)
    print(f"{target_model.name} turn 2: {passed2}/{n // 2} well-formed")
    assert passed2 >= len(second) - 1


def test_dense_target_is_a_flat_qwen3(model_cache: Path) -> None:
    shape = TargetShape.from_dir(ensure_tiny_model(model_cache))
    assert shape.architectures == ("Qwen3ForCausalLM",) and not shape.is_hybrid
    assert (shape.hidden_size, shape.num_layers, shape.context_length) == (128, 8, 4096)


def test_hybrid_target_has_qwen36_on_disk_shape(model_cache: Path) -> None:
    from safetensors import safe_open

    path = ensure_tiny_model(model_cache, "tiny-qwen3.5")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5" and not config["tie_word_embeddings"]
    text = config["text_config"]
    assert "hidden_size" not in config and "max_position_embeddings" not in config
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert text["mtp_num_hidden_layers"] == 1
    assert text["rope_parameters"]["mrope_section"] and text["rope_parameters"]["mrope_interleaved"]
    shape = TargetShape.from_dir(path)
    assert shape.is_hybrid and shape.has_mtp and shape.full_attention_layers == [3, 7]
    assert (shape.hidden_size, shape.num_layers, shape.context_length) == (128, 8, 4096)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Spare embedding rows past the tokenizer, as Qwen pads; the vision markers sit at the top.
    assert shape.vocab_size > len(tokenizer) and shape.vocab_size % 256 == 0
    assert config["vision_end_token_id"] == shape.vocab_size - 1
    assert config["image_token_id"] >= len(tokenizer)
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        embed = weights.get_tensor("model.language_model.embed_tokens.weight")
    assert embed.shape == (shape.vocab_size, 128) and "lm_head.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= names
    # transformers maps qwen3_5 to the text model; the vision tower and mtp.* are left out.
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert TargetShape.of(model).layer_types == shape.layer_types
    ids = tokenizer("Hello there", return_tensors="pt")
    with torch.no_grad():
        out = model(**ids, output_hidden_states=True)
    width = ids.input_ids.shape[1]
    assert len(out.hidden_states) == 9 and out.hidden_states[-1].shape == (1, width, 128)
    assert out.logits.shape[-1] == shape.vocab_size


# Steps the concurrency test's builds train: its lock, temporary directory and rename are what it
# proves, and the tokenizer and config it compares do not depend on the steps (the full dense
# build trains 600; the session's cache proves the recipe).
_CONCURRENT_BUILD_STEPS = 20


def _ensure_in_child(cache_dir: Path, results: multiprocessing.Queue,
                     ready: multiprocessing.synchronize.Barrier) -> None:
    """Child-process body for the concurrency test: report the path and when it returned."""
    from embedded import tinybuild

    tinybuild._TRAIN_STEPS = _CONCURRENT_BUILD_STEPS
    ready.wait(timeout=300)   # both imports done: the two calls start together
    started = time.time()
    results.put((str(ensure_tiny_model(cache_dir)), started, time.time()))


def test_cached_call_is_fast_and_concurrent_builds_share_one_dir(
    model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense build (the hybrid's shares the same lock and cache code)."""
    from embedded.tinyconsts import tiny_model_dir

    tiny_path = tiny_model_dir(model_cache)
    def no_build(_: Path) -> None:
        raise AssertionError("a cached model was built again")

    with monkeypatch.context() as patch:   # cached: returned as is, never rebuilt
        patch.setattr("embedded.tinybuild.build", no_build)
        assert ensure_tiny_model(tiny_path.parent) == tiny_path

    ctx = multiprocessing.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_ensure_in_child, args=(tmp_path, results, ready))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    paths = {path for path, _, _ in got}
    assert paths == {str(tmp_path / f"tiny-qwen3-{TINY_MODEL_VERSION}")}
    # Both calls were in flight at once, so the lock (not luck) kept them from clashing.
    assert max(start for _, start, _ in got) < min(end for _, _, end in got)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"tiny-qwen3-{TINY_MODEL_VERSION}",
        "tiny-qwen3.lock",
    ]
    # Same seeds, same corpus: the tokenizer and config come out byte-identical.
    for name in ("tokenizer.json", "config.json"):
        assert (tmp_path / f"tiny-qwen3-{TINY_MODEL_VERSION}" / name).read_bytes() == (
            tiny_path / name
        ).read_bytes()
