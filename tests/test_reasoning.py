"""Reasoning split on token ids, on both embedded tokenizers: a reply on a prefilled think block
(Qwen3.5/3.6's generation prompt), a reply that opens its own (Qwen3), and the gates' verdicts on
an unclosed block, an empty answer and a second ``</think>``."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.engine.sampling import Sampling
from common.gates.judge import GateConfig, TokenInfo, inspect_turn, judge
from common.gates.reasoning import opened_by_prompt, split_ids
from common.gates.turns import answer_message, render_prompt
from tests.conftest import TinyTarget


@pytest.fixture(scope="module")
def tok(target_model: TinyTarget):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(target_model.path))


def ids(tok, text: str) -> list[int]:  # noqa: ANN001
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def verdict(tok, prompt: list[int], reply: list[int]) -> tuple[dict, dict]:  # noqa: ANN001
    info = TokenInfo.of(tok)
    message = answer_message(tok, info, prompt, reply)
    text = tok.decode(reply, skip_special_tokens=False)
    facts = inspect_turn(info, prompt, reply, text, message["content"], "stop")
    return message, judge([facts], GateConfig(min_supervised_tokens=0), thinking=True)


def prompts(tok) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The thinking-on prompt without and with the opened think block: the hybrid's template
    (Qwen3.5/3.6's) renders the second, Qwen3's the first."""
    on = render_prompt(tok, [{"role": "user", "content": "Hi"}], Sampling())
    think = tok.convert_tokens_to_ids("<think>")
    if on[-2:-1] == [think] or on[-1:] == [think]:
        return on[:len(on) - on[::-1].index(think) - 1], on
    return on, on + ids(tok, "<think>\n")


def test_a_reply_on_a_prefilled_think_block_splits_on_its_ids(
        tok, target_model: TinyTarget) -> None:  # noqa: ANN001
    info = TokenInfo.of(tok)
    plain, prefilled = prompts(tok)
    rendered = render_prompt(tok, [{"role": "user", "content": "Hi"}], Sampling())
    assert rendered == (prefilled if target_model.hybrid else plain)  # the template decides
    assert opened_by_prompt(info, prefilled) and not opened_by_prompt(info, plain)
    off = render_prompt(tok, [{"role": "user", "content": "Hi"}], Sampling(thinking=False))
    assert not opened_by_prompt(info, off)              # the empty block is closed
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = ids(tok, "Let me see.\n</think>\n\nHello there.") + [end]
    message, quality = verdict(tok, prefilled, reply)
    assert message == {"role": "assistant", "reasoning_content": "Let me see.",
                       "content": "Hello there."}
    assert quality["passed"], quality
    split = split_ids(info, prefilled, reply)
    assert split.closed and tok.decode(split.reasoning).strip() == "Let me see."
    # Qwen3: the reply opens its own block, after a newline or not.
    own = ids(tok, "\n<think>\nLet me see.\n</think>\n\nHello there.") + [end]
    assert verdict(tok, plain, own)[0] == message


def test_unclosed_empty_and_doubled_blocks_are_rejected(tok) -> None:  # noqa: ANN001
    end = tok.convert_tokens_to_ids("<|im_end|>")
    _, prefilled = prompts(tok)
    message, quality = verdict(tok, prefilled, ids(tok, "Still thinking about it"))
    assert message["reasoning_content"] == "Still thinking about it" and not message["content"]
    assert quality["reasons"] == ["thinking_unclosed"]
    message, quality = verdict(tok, prefilled, ids(tok, "Done.\n</think>\n\n") + [end])
    assert message == {"role": "assistant", "reasoning_content": "Done.", "content": ""}
    assert quality["reasons"] == ["empty_answer"]
    message, quality = verdict(tok, prefilled,
                               ids(tok, "A.\n</think>\n\nB.\n</think>\n\nC.") + [end])
    assert message["reasoning_content"] == "A." and "</think>" in message["content"]
    assert "think_in_answer" in quality["reasons"], quality
