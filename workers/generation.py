"""Turn-by-turn regeneration of conversations into sample records.

Each assistant turn answers the conversation so far: earlier turns are the target's own
regenerated answers, rendered by the tokenizer's chat template (``apply_chat_template``), which
for Qwen3-style templates drops the reasoning of earlier turns exactly as at inference time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.records import Sampling
from workers.engine import Engine, GenRequest, GenResult

_THINK = re.compile(r"^\s*<think>(.*?)(</think>|$)(.*)$", re.DOTALL)


@dataclass
class Pending:
    """One conversation being regenerated: its input row and the answers so far."""

    row: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def next_turn(self) -> int:
        return len(self.turns)

    @property
    def finished(self) -> bool:
        return self.next_turn >= len(self.row["turns"])


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """Split output text into (reasoning_content, content); an unclosed block is all reasoning."""
    match = _THINK.match(text) if thinking else None
    if not match:
        return "", text.strip()
    return match.group(1).strip(), match.group(3).strip()


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], sampling: Sampling) -> list[int]:
    """The chat template applied once, thinking on or off, tokenized without extra specials."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=sampling.thinking
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _answer(tokenizer: Any, result: GenResult, thinking: bool) -> dict[str, Any]:
    text = tokenizer.decode(result.output_ids, skip_special_tokens=False)
    for token in tokenizer.all_special_tokens:
        if token not in ("<think>", "</think>"):
            text = text.replace(token, "")
    reasoning, content = split_reasoning(text, thinking)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def _record(item: Pending, shard: int, engine_info: dict[str, Any]) -> dict[str, Any]:
    last = item.turns[-1]
    return {
        "id": item.row["id"],
        "shard": shard,
        "source": item.row.get("source", {}),
        "messages": item.messages,
        "prompt_ids": last["prompt_ids"],
        "output_ids": last["output_ids"],
        "finish_reason": last["finish_reason"],
        "turns": item.turns,
        "usage": {
            "prompt_tokens": sum(t["prompt_tokens"] for t in item.turns),
            "completion_tokens": sum(t["completion_tokens"] for t in item.turns),
        },
        "latency_s": round(sum(t["latency_s"] for t in item.turns), 4),
        "engine": engine_info,
    }


def regenerate(
    engine: Engine,
    rows: Sequence[dict[str, Any]],
    sampling: Sampling,
    shard: int,
    chunk: int,
    on_requests: Callable[[int], None] = lambda n: None,
) -> Iterator[dict[str, Any]]:
    """Yield finished sample records, ``chunk`` conversations at a time, every turn regenerated."""
    info = engine.info()
    for start in range(0, len(rows), chunk):
        active = [Pending(row) for row in rows[start : start + chunk]]
        while active:
            requests = []
            for item in active:
                item.messages.extend(item.row["turns"][item.next_turn])
                prompt = render_prompt(engine.tokenizer, item.messages, sampling)
                requests.append(GenRequest(input_ids=prompt, sampling=sampling))
            on_requests(len(requests))
            for item, request, result in zip(active, requests, engine.generate(requests),
                                             strict=True):
                item.messages.append(_answer(engine.tokenizer, result, sampling.thinking))
                item.turns.append({
                    "prompt_ids": request.input_ids,
                    "output_ids": result.output_ids,
                    "finish_reason": result.finish_reason,
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "latency_s": round(result.latency_s, 4),
                })
            yield from (_record(i, shard, info) for i in active if i.finished)
            active = [i for i in active if not i.finished]
