"""``bench --run``'s closed loop: the run's conversations, every turn, as the worker runs them.

    row = asyncio.run(run_loop(url, 128, conversations, mtp=MtpMode.ON))

Every drawn conversation starts at once; each request waits for one of ``concurrency`` slots
(the worker's in-flight cap does the same), so that many requests stay in flight while any are
left. A conversation's next turn answers the conversation so far (the target's own reply to the
turn before, split into reasoning and answer: :mod:`common.gates.turns`), rendered in the row's
thinking mode with the run's template options and tools; it stops at its first turn the quality
gates reject, or that no longer fits the server's context, as in the worker. The rate is taken
over the steady window (:func:`producer.bench.steady_row`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.choices import MtpMode
from common.engine.serving import sampling_params
from common.errors import DflashError
from common.gates.judge import TokenInfo, inspect_turn, judge
from common.gates.turns import answer_message, decode, render_prompt
from common.runs.records import RunConfig
from producer.bench import BenchRow, Sent, post, steady_row


@dataclass(frozen=True)
class Conversations:
    """What the loop runs: the drawn rows, and how the worker would render and judge them."""

    rows: list[dict[str, Any]]
    config: RunConfig
    tokenizer: Any
    stop_ids: list[int]
    context: int | None   # the server's context length (None: not stated)

    @property
    def tokens(self) -> TokenInfo:
        return TokenInfo.of(self.tokenizer)


async def run_loop(url: str, concurrency: int, work: Conversations,
                   mtp: MtpMode | None = None) -> BenchRow:
    """Every conversation of ``work`` with ``concurrency`` requests in flight; the row."""
    slots, sent = asyncio.Semaphore(concurrency), []
    tokens = work.tokens
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def ask(ids: list[int]) -> dict[str, Any] | None:
            room = work.config.sampling.max_new_tokens
            if work.context is not None:
                room = min(room, work.context - len(ids))
            if room < 1:
                return None
            body = {"input_ids": ids, "stream": False, "sampling_params": sampling_params(
                work.config.sampling, room, work.stop_ids)}
            ready = time.perf_counter()   # waits for a slot from here (the window's fall)
            async with slots:
                one, data = await post(s, url, body, ready)
            sent.append(one)
            return data

        async def conversation(row: dict[str, Any]) -> None:
            await run_conversation(work, tokens, row, ask)

        await asyncio.gather(*(conversation(row) for row in work.rows))
    return steady_row(sent, concurrency, mtp, conversations=len(work.rows))


async def run_conversation(work: Conversations, tokens: TokenInfo, row: dict[str, Any],
                           ask: Any) -> None:
    """One conversation's turns in order, each answering the conversation so far."""
    config, tokenizer = work.config, work.tokenizer
    thinking = config.sampling.thinking_for(row["id"])
    messages: list[dict[str, Any]] = []
    for number, group in enumerate(row["turns"], start=1):
        messages.extend(group)
        ids = render_prompt(tokenizer, messages, thinking, config.chat_template_kwargs,
                            row.get("tools"))
        data = await ask(ids)
        if data is None:
            return
        output = data.get("output_ids")
        if not isinstance(output, list):
            raise DflashError(f"/generate answered without output_ids: {str(data)[:200]}")
        reason = (data.get("meta_info", {}).get("finish_reason") or {})
        finish = reason.get("type", "stop") if isinstance(reason, dict) else str(reason)
        answer = answer_message(tokenizer, tokens, ids, output)
        facts = inspect_turn(tokens, ids, output, decode(tokenizer, output), answer["content"],
                             finish)
        if not judge([facts], config.gates, thinking, first=number)["passed"]:
            return
        messages.append(answer)


__all__ = ["Conversations", "Sent", "run_loop"]
