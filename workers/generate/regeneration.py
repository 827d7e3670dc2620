"""Turn-by-turn regeneration of conversations into sample records.

Each assistant turn answers the conversation so far: earlier turns are the target's own
regenerated answers (reasoning apart from content), rendered with the row's tools by the
target's chat template (``apply_chat_template``), which decides what of earlier reasoning the
history shows, exactly as at inference time. Each conversation renders in its own thinking mode
(``--thinking mix:R``). A turn is judged when it finishes: the conversation stops at its first
rejected turn (no request is sent for the turns after it); the turns before it are kept and
train, and the record keeps the rejected one under ``quality.stopped``. Every conversation of a
shard is submitted at once to the worker's engine loop; the engine's in-flight cap (shared by
all shards the worker holds) decides how many run at a time.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from common.choices import FinishReason, Reason
from common.errors import EngineRefusesAll, RequestRefused
from common.gates.judge import GateConfig, TokenInfo, TurnFacts, answer_hash, inspect_turn, judge
from common.gates.turns import answer_message, decode, render_prompt
from common.runs.records import RunConfig
from workers.generate.engines.base import (
    Engine,
    EngineInfo,
    EngineLoop,
    GenRequest,
    GenResult,
)

# A shard parks (instead of storing every sample as rejected) when this many of its first
# requests, or all of a smaller shard's, are refused by the engine with none answered.
REFUSALS_TO_PARK = 8


@dataclass
class ShardCounters:
    """Engine requests sent for one shard (read by the task thread when it writes a part)."""

    requests: int = 0
    answered: int = 0   # requests the engine answered (2xx)


class Refusal(TypedDict):
    """Why the engine never generated a turn: its reason and words."""

    reason: str
    message: str


class GeneratedTurn(TypedDict):
    """One turn as a sample stores it (``turns[i]``): its ids, counts and time."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    speculative: NotRequired[dict[str, Any]]   # the engine's spec_* figures, as it gave them
    refused: NotRequired[Refusal]              # never generated (no output)


class StoppedTurn(GeneratedTurn):
    """The first rejected turn of a conversation: its number, answer (None: never generated)
    and verdict."""

    turn: int
    answer: dict[str, Any] | None
    verdict: dict[str, Any]


def _turn(request: GenRequest, result: GenResult) -> GeneratedTurn:
    turn: GeneratedTurn = {
        "prompt_ids": request.input_ids,
        "output_ids": result.output_ids,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "latency_s": round(result.latency_s, 4),
    }
    if result.speculative:   # the engine's spec_* figures (common.engine.speculative), as given
        turn["speculative"] = result.speculative
    return turn


def _record(row: dict[str, Any], shard: int, messages: list[dict[str, Any]],
            turns: list[GeneratedTurn], engine_info: EngineInfo, quality: dict[str, Any],
            thinking: bool, spent: list[GeneratedTurn]) -> dict[str, Any]:
    last = turns[-1]
    record = {
        "id": row["id"],
        "shard": shard,
        "source": row.get("source", {}),
        "messages": messages,
        "prompt_ids": last["prompt_ids"],
        "output_ids": last["output_ids"],
        "finish_reason": last["finish_reason"],
        "turns": turns,
        "thinking": thinking,
        # Every generated turn's tokens, the rejected one included: engine time spent.
        "usage": {
            "prompt_tokens": sum(t["prompt_tokens"] for t in spent),
            "completion_tokens": sum(t["completion_tokens"] for t in spent),
        },
        "latency_s": round(sum(t["latency_s"] for t in spent), 4),
        "engine": engine_info,
        "quality": quality,
    }
    if row.get("tools"):
        record["tools"] = row["tools"]
    return record


@dataclass(frozen=True)
class Job:
    """What every conversation of a shard is generated and judged with."""

    engine: Engine
    config: RunConfig   # the run's frozen config, whole: sampling, gates, template options, ...
    shard: int
    counters: ShardCounters
    tokens: TokenInfo


@dataclass
class _Conversation:
    """A conversation as it is regenerated: the turns that passed, and the one that did not."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[GeneratedTurn] = field(default_factory=list)
    facts: list[TurnFacts] = field(default_factory=list)
    stopped: StoppedTurn | None = None   # the first rejected turn: its verdict and tokens
    kept_messages: int = 0   # the history up to the last kept answer (its next turn's input out)

    def keep(self, answer: dict[str, Any], turn: GeneratedTurn, facts: TurnFacts) -> None:
        self.messages.append(answer)
        self.turns.append(turn)
        self.facts.append(facts)
        self.kept_messages = len(self.messages)


async def regenerate_one(job: Job, row: dict[str, Any]) -> dict[str, Any]:
    """One conversation, each assistant turn answering the conversation so far and judged as
    it finishes; the first rejected turn ends it."""
    config = job.config
    thinking = config.sampling.thinking_for(row["id"])
    convo = _Conversation()
    turns = row["turns"][:config.max_turns] if config.max_turns else row["turns"]
    for number, group in enumerate(turns, start=1):
        convo.messages.extend(group)
        request = GenRequest(render_prompt(job.engine.tokenizer, convo.messages, thinking,
                                           config.chat_template_kwargs, row.get("tools")),
                             config.sampling, config.gates.min_answer_tokens)
        convo.stopped = await _turn_of(job, request, convo, number, thinking)
        if convo.stopped is not None:
            break
    return _record(row, job.shard, *_kept(convo), job.engine.info(),
                   _quality(convo, config.gates, thinking), thinking, _spent(convo))


async def _turn_of(job: Job, request: GenRequest, convo: _Conversation, number: int,
                   thinking: bool) -> StoppedTurn | None:
    """Generate and judge one turn; keep it if it passes, else return what stopped it."""
    job.counters.requests += 1
    try:
        result = await job.engine.generate(request)
    except RequestRefused as exc:   # this sample only: the turns after it are not sent
        if exc.reason == Reason.CONTEXT_OVERFLOW:
            job.counters.requests -= 1   # fitted out before it was sent
        return {**_refused_turn(request, exc), "turn": number, "answer": None,
                "verdict": refused_verdict(exc, number)}
    job.counters.answered += 1
    tokenizer = job.engine.tokenizer
    answer = answer_message(tokenizer, job.tokens, request.input_ids, result.output_ids)
    facts = inspect_turn(job.tokens, request.input_ids, result.output_ids,
                         decode(tokenizer, result.output_ids), answer["content"],
                         result.finish_reason)
    verdict = judge([facts], job.config.gates, thinking, first=number)
    if verdict["passed"]:
        convo.keep(answer, _turn(request, result), facts)
        return None
    return {**_turn(request, result), "turn": number, "answer": answer, "verdict": verdict}


def refused_verdict(refused: RequestRefused, number: int) -> dict[str, Any]:
    """The verdict on a turn the engine never generated."""
    return {"passed": False, "reasons": [str(refused.reason)],
            "details": [f"turn {number}: {refused}"], "supervised_tokens": [0],
            "thinking_tokens": [0]}


def _kept(convo: _Conversation) -> tuple[list[dict[str, Any]], list[GeneratedTurn]]:
    """Messages and turns the record holds: those that passed, or the rejected first turn."""
    if convo.stopped is None:
        return convo.messages, convo.turns
    if convo.turns:   # the stopped turn's own input is not kept: end on the last kept answer
        return convo.messages[:convo.kept_messages], convo.turns
    stopped = convo.stopped
    answer = [stopped["answer"]] if stopped["answer"] is not None else []
    return convo.messages + answer, [_generated(stopped)]


def _generated(stopped: StoppedTurn) -> GeneratedTurn:
    """The stopped turn as a sample's turn (its number, answer and verdict left out)."""
    turn: GeneratedTurn = {
        "prompt_ids": stopped["prompt_ids"], "output_ids": stopped["output_ids"],
        "finish_reason": stopped["finish_reason"], "prompt_tokens": stopped["prompt_tokens"],
        "completion_tokens": stopped["completion_tokens"], "latency_s": stopped["latency_s"]}
    if "speculative" in stopped:
        turn["speculative"] = stopped["speculative"]
    if "refused" in stopped:
        turn["refused"] = stopped["refused"]
    return turn


def _spent(convo: _Conversation) -> list[GeneratedTurn]:
    return convo.turns + ([convo.stopped] if convo.stopped is not None else [])


def _quality(convo: _Conversation, gates: GateConfig, thinking: bool) -> dict[str, Any]:
    """The sample's verdict: passed when its first turn did; a later rejected turn is kept
    under ``stopped`` (its number, reasons, details and tokens) and counted per turn."""
    stopped = convo.stopped
    if not convo.turns and stopped is not None:
        quality = dict(stopped["verdict"])
        quality["answer_hash"] = answer_hash([(stopped["answer"] or {}).get("content", "")])
    else:
        quality = judge(convo.facts, gates, thinking)
    quality["turns_passed"] = len(convo.turns)
    quality["thinking"] = thinking
    if convo.turns and stopped is not None:
        verdict = stopped["verdict"]
        quality["stopped"] = {
            "turn": stopped["turn"], "reasons": verdict["reasons"],
            "details": verdict["details"], "finish_reason": stopped["finish_reason"],
            "prompt_ids": stopped["prompt_ids"], "output_ids": stopped["output_ids"],
            "answer": stopped["answer"], "supervised_tokens": verdict["supervised_tokens"][0]}
        if "refused" in stopped:   # never generated: the engine's reason and words
            quality["stopped"]["refused"] = stopped["refused"]
    return quality


def _refused_turn(request: GenRequest, refused: RequestRefused) -> GeneratedTurn:
    """A turn the engine never generated: its prompt, no output, and why."""
    return {"prompt_ids": request.input_ids, "output_ids": [], "finish_reason": FinishReason.ABORT,
            "prompt_tokens": len(request.input_ids), "completion_tokens": 0, "latency_s": 0.0,
            "refused": {"reason": str(refused.reason), "message": str(refused)}}


def _refused_by_engine(sample: dict[str, Any]) -> bool:
    return Reason.ENGINE_REFUSED.value in sample["quality"]["reasons"]


def regenerate(loop: EngineLoop, job: Job,
               rows: Sequence[dict[str, Any]]) -> Generator[dict[str, Any], None, None]:
    """Yield finished samples in completion order; closing the iterator cancels the rest."""
    done: queue.SimpleQueue[dict[str, Any] | _Failed] = queue.SimpleQueue()

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
