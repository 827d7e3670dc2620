"""Turn-by-turn regeneration of conversations into sample records.

Each assistant turn answers the conversation so far: earlier turns are the target's own
regenerated answers, rendered by the tokenizer's chat template (``apply_chat_template``), which
for Qwen3-style templates drops the reasoning of earlier turns exactly as at inference time.
Every conversation of a shard is submitted at once to the worker's engine loop; the engine's
in-flight cap (shared by all shards the worker holds) decides how many run at a time.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import EngineRefusesAll, RequestRefused
from common.gates import (
    GateConfig,
    Reason,
    TokenInfo,
    TurnFacts,
    inspect_turn,
    judge,
)
from common.models import render_chat
from common.reasoning import split_ids
from common.records import Sampling
from workers.generate.engines.base import Engine, EngineLoop, GenRequest, GenResult

# A shard parks (instead of storing every sample as rejected) when this many of its first
# requests, or all of a smaller shard's, are refused by the engine with none answered.
REFUSALS_TO_PARK = 8


@dataclass
class ShardCounters:
    """Engine requests sent for one shard (read by the task thread when it writes a part)."""

    requests: int = 0
    answered: int = 0   # requests the engine answered (2xx)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], sampling: Sampling,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template applied once, thinking on or off, tokenized without extra specials."""
    text = render_chat(tokenizer, messages, sampling.thinking, template_kwargs)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer directly: same ids, without the Python wrapper's per-call overhead.
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (backend.decode(ids, skip_special_tokens=False) if backend is not None
            else tokenizer.decode(ids, skip_special_tokens=False))


def answer_message(tokenizer: Any, tokens: TokenInfo, prompt_ids: list[int],
                   output_ids: list[int]) -> dict[str, Any]:
    """The assistant message of a reply, split on its token ids (:mod:`common.reasoning`)."""
    def text(ids: list[int]) -> str:
        decoded = _decode(tokenizer, ids)
        for token in tokens.special_texts:
            decoded = decoded.replace(token, "")
        return decoded.strip()

    split = split_ids(tokens, prompt_ids, output_ids, lambda ids: not text(ids))
    return {"role": "assistant", "content": text(split.answer),
            "reasoning_content": text(split.reasoning) if split.reasoning is not None else ""}


def _turn(request: GenRequest, result: GenResult) -> dict[str, Any]:
    return {
        "prompt_ids": request.input_ids,
        "output_ids": result.output_ids,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "latency_s": round(result.latency_s, 4),
    }


def _record(row: dict[str, Any], shard: int, messages: list[dict[str, Any]],
            turns: list[dict[str, Any]], engine_info: dict[str, Any],
            quality: dict[str, Any]) -> dict[str, Any]:
    last = turns[-1]
    return {
        "id": row["id"],
        "shard": shard,
        "source": row.get("source", {}),
        "messages": messages,
        "prompt_ids": last["prompt_ids"],
        "output_ids": last["output_ids"],
        "finish_reason": last["finish_reason"],
        "turns": turns,
        "usage": {
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
        },
        "latency_s": round(sum(t["latency_s"] for t in turns), 4),
        "engine": engine_info,
        "quality": quality,
    }


@dataclass(frozen=True)
class Job:
    """What every conversation of a shard is generated and judged with."""

    engine: Engine
    sampling: Sampling
    gates: GateConfig
    shard: int
    counters: ShardCounters
    tokens: TokenInfo
    template_kwargs: dict[str, Any] = field(default_factory=dict)


async def regenerate_one(job: Job, row: dict[str, Any]) -> dict[str, Any]:
    """One conversation, every assistant turn answering the conversation so far."""
    tokenizer, sampling = job.engine.tokenizer, job.sampling
    messages: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    facts: list[TurnFacts] = []
    refused: RequestRefused | None = None
    for group in row["turns"]:
        messages.extend(group)
        request = GenRequest(render_prompt(tokenizer, messages, sampling, job.template_kwargs),
                             sampling, job.gates.min_answer_tokens)
        job.counters.requests += 1
        try:
            result = await job.engine.generate(request)
        except RequestRefused as exc:   # this sample only: the turns after it are not sent
            refused = exc
            if exc.reason == Reason.CONTEXT_OVERFLOW:
                job.counters.requests -= 1   # fitted out before it was sent
            turns.append(_refused_turn(request, exc))
            break
        job.counters.answered += 1
        raw = _decode(tokenizer, result.output_ids)
        answer = answer_message(tokenizer, job.tokens, request.input_ids, result.output_ids)
        messages.append(answer)
        turns.append(_turn(request, result))
        facts.append(inspect_turn(job.tokens, request.input_ids, result.output_ids, raw,
                                  answer["content"], result.finish_reason))
    quality = judge(facts, job.gates, sampling.thinking)
    if refused is not None:
        quality["passed"] = False
        quality["reasons"].append(str(refused.reason))
        quality["details"].append(f"turn {len(turns)}: {refused}")
    return _record(row, job.shard, messages, turns, job.engine.info(), quality)


def _refused_turn(request: GenRequest, refused: RequestRefused) -> dict[str, Any]:
    """A turn the engine never generated: its prompt, no output, and why."""
    return {"prompt_ids": request.input_ids, "output_ids": [], "finish_reason": "abort",
            "prompt_tokens": len(request.input_ids), "completion_tokens": 0, "latency_s": 0.0,
            "refused": {"reason": str(refused.reason), "message": str(refused)}}


def _refused_by_engine(sample: dict[str, Any]) -> bool:
    return Reason.ENGINE_REFUSED.value in sample["quality"]["reasons"]


def regenerate(loop: EngineLoop, job: Job,
               rows: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Yield finished samples in completion order; closing the iterator cancels the rest."""
    done: queue.SimpleQueue = queue.SimpleQueue()

    async def one(row: dict[str, Any]) -> None:
        try:
            done.put(await regenerate_one(job, row))
        except Exception as exc:  # handed to the task thread, which raises it there
            done.put(_Failed(exc))

    async def every_row() -> None:
        await asyncio.gather(*(one(row) for row in rows))

    # One cross-thread future per shard, not per row: results come back through the queue.
    future = loop.submit(every_row())
    # Refused samples wait until the engine has answered one request of this shard: a setting
    # the engine refuses parks the shard instead of being stored as every sample's fault.
    held: list[dict[str, Any]] = []
    try:
        for _ in rows:
            item = done.get()
            if isinstance(item, _Failed):
                raise item.error
            if job.counters.answered == 0 and _refused_by_engine(item):
                held.append(item)
                if len(held) >= min(len(rows), REFUSALS_TO_PARK):
                    raise EngineRefusesAll(f"the engine refused all {len(held)} requests "
                                           f"sent: {item['quality']['details'][-1]}")
                continue
            yield from held
            held.clear()
            yield item
        yield from held
    finally:
        future.cancel()


@dataclass(frozen=True, slots=True)
class _Failed:
    error: Exception
