"""One assistant turn as the target sees it and as the conversation keeps it: the prompt
rendered by the chat template, the reply split into reasoning and answer on its token ids. The
generate worker's regeneration and ``bench --run``'s closed loop both run turns through these.
"""

from __future__ import annotations

from typing import Any

from common.engine.models import render_chat
from common.engine.sampling import Sampling
from common.gates.judge import TokenInfo
from common.gates.reasoning import split_ids


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], thinking: Sampling | bool,
                  template_kwargs: dict[str, Any] | None = None,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template applied once, thinking on or off, tokenized without extra specials."""
    if isinstance(thinking, Sampling):
        thinking = thinking.thinking
    text = render_chat(tokenizer, messages, thinking, template_kwargs, tools)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer directly: same ids, without the Python wrapper's per-call overhead.
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return ids
    encoded: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return encoded


def decode(tokenizer: Any, ids: list[int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text: str = (backend.decode(ids, skip_special_tokens=False) if backend is not None
                 else tokenizer.decode(ids, skip_special_tokens=False))
    return text


def answer_message(tokenizer: Any, tokens: TokenInfo, prompt_ids: list[int],
                   output_ids: list[int]) -> dict[str, Any]:
    """The assistant message of a reply, split on its token ids (:mod:`common.gates.reasoning`)."""
    def text(ids: list[int]) -> str:
        decoded = decode(tokenizer, ids)
        for token in tokens.special_texts:
            decoded = decoded.replace(token, "")
        return decoded.strip()

    split = split_ids(tokens, prompt_ids, output_ids, lambda ids: not text(ids))
    return {"role": "assistant", "content": text(split.answer),
            "reasoning_content": text(split.reasoning) if split.reasoning is not None else ""}
