"""Reasoning split on token ids, never on a text prefix: one rule for the stored record, the
gates' facts and the next turn's history.

A reply is inside a think block when its prompt ends inside one (Qwen3.5/3.6's generation prompt
with thinking on ends ``<think>\\n``: the reply never emits ``<think>``) or when the reply opens
one first (Qwen3). The ids before the first ``</think>`` are the reasoning, the ids after it the
answer, each decoded on its own; a block never closed is all reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.gates.judge import TokenInfo, opened_by_prompt


@dataclass(frozen=True, slots=True)
class Split:
    """A reply's ids in two parts; ``reasoning`` is None when no think block was opened."""

    reasoning: list[int] | None
    answer: list[int]
    closed: bool


def split_ids(info: TokenInfo, prompt_ids: Sequence[int], output_ids: Sequence[int],
              is_blank: Callable[[list[int]], bool] = lambda ids: not ids) -> Split:
    """Reasoning and answer ids of a reply; ``is_blank`` says whether ids before a ``<think>``
    are only whitespace (the reply then opens its own block)."""
    ids = list(output_ids)
    start: int | None = 0 if opened_by_prompt(info, prompt_ids) else None
    if start is None and info.think_open is not None and info.think_open in ids:
        first = ids.index(info.think_open)
        start = first + 1 if is_blank(ids[:first]) else None
    if start is None:
        return Split(None, ids, closed=info.think_close in ids)
    if info.think_close is not None and info.think_close in ids[start:]:
        close = ids.index(info.think_close, start)
        return Split(ids[start:close], ids[close + 1:], closed=True)
    return Split(ids[start:], [], closed=False)
