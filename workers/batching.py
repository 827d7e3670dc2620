"""Rows grouped by length under a token budget: the hidden worker's batches and the trainer's
micro-batches are one mechanism.

    batches, padding = length_batches(rows, max_tokens=32768, max_rows=64)     # hidden stage
    micro, _ = length_batches(pairs, max_tokens=budget, max_rows=len(pairs), max_waste=None,
                              size=lambda p: len(p[0].input_ids), extra=lambda p: draft(p))

Longest first, so rows of similar length share a batch and are padded only to each other; a
batch closes before its padded tokens (rows x its longest row) would pass ``max_tokens``, before
the sum of ``extra`` (the trainer's draft positions: anchors x block) would, and before its
padding would pass ``max_waste`` of its real tokens. A row above the budget goes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from common.runs.trainrows import TrainingRow

Item = TypeVar("Item")


@dataclass(frozen=True)
class PaddingStats:
    """How much of the batched compute was padding: ``waste = padded_tokens / real_tokens``."""

    rows: int
    batches: int
    real_tokens: int
    padded_tokens: int

    @property
    def waste(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


def row_tokens(row: Any) -> int:
    """A training row's length (the default ``size``)."""
    return len(row.input_ids)


def _row_order(row: Any) -> tuple[Any, ...]:
    """Longest first; training rows of one length in (sample id, turn) order."""
    if isinstance(row, TrainingRow):
        return (-len(row.input_ids), row.sample_id, row.turn)
    return (-row_tokens(row),)


def length_batches(rows: Sequence[Item], max_tokens: int = 32768, max_rows: int = 64,
                   max_waste: float | None = 0.05, sort: bool = True,
                   size: Callable[[Item], int] = row_tokens,
                   extra: Callable[[Item], int] | None = None,
                   ) -> tuple[list[list[Item]], PaddingStats]:
    """Group ``rows`` so a padded batch stays under ``max_tokens`` and ``max_rows`` (and the sum
    of ``extra`` under ``max_tokens``); ``sort=False, max_waste=None`` is plain batching in input
    order, for comparison. A row above the budget goes alone."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError("max_tokens and max_rows must be positive")
    order = list(rows)
    if sort:
        order.sort(key=_row_order if size is row_tokens else (lambda r: -size(r)))
    batches: list[list[Item]] = []
    batch: list[Item] = []
    width = real = cost = 0
    for row in order:
        n, more = size(row), (extra(row) if extra else 0)
        new_width, new_real, new_cost = max(width, n), real + n, cost + more
        too_wasteful = (max_waste is not None
                        and new_width * (len(batch) + 1) - new_real > max_waste * new_real)
        if batch and (len(batch) >= max_rows or new_width * (len(batch) + 1) > max_tokens
                      or new_cost > max_tokens or too_wasteful):
            batches.append(batch)
            batch, new_width, new_real, new_cost = [], n, n, more
        batch.append(row)
        width, real, cost = new_width, new_real, new_cost
    if batch:
        batches.append(batch)
    real = sum(size(r) for r in order)
    slots = sum(len(b) * max(size(r) for r in b) for b in batches)
    return batches, PaddingStats(len(order), len(batches), real, slots - real)
