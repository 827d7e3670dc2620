"""A training step's rows in micro-batches under a token budget, the update still the one-batch
update: what a step holds on the GPU is bounded by the budget, never by rows x the longest row.

    drawn = [Drawn(row, anchors), ...]                 # anchors drawn once, for the whole step
    total = label_weight(drawn, weights, block_size)   # the one-batch loss's denominator
    for part in micro_batches(drawn, budget, block_size):
        loss_sum, slots = trainer.forward_sum(trainer.pack(part))
        (loss_sum / total).backward()                  # gradients add up to the one-batch ones

A micro-batch closes before its padded target tokens (rows x its longest row) or its draft
positions (anchors x block size) would pass the budget (:func:`workers.batching.length_batches`);
a row above the budget goes alone. Each micro-batch's loss is divided by the *step's* label
weight, so the accumulated gradient is the gradient of the one-batch loss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.batching import length_batches
from workers.train.drafter.blocks import block_labels
from workers.train.drafter.features import TrainRow, plain_row

log = logging.getLogger(__name__)

NO_BUDGET = 0   # one micro-batch: the whole step at once


@dataclass(frozen=True)
class Drawn:
    """A row of a step (plain, or with stored features) and the anchors drawn for it."""

    row: TrainRow
    anchors: torch.Tensor

    @property
    def tokens(self) -> int:
        return len(plain_row(self.row).input_ids)

    def draft_positions(self, block_size: int) -> int:
        return int(self.anchors.numel()) * block_size


def micro_batches(drawn: Sequence[Drawn], budget: int,
                  block_size: int) -> list[list[Drawn]]:
    """``drawn`` grouped longest first under ``budget`` tokens (padded target tokens and draft
    positions alike); one group with no budget."""
    if not drawn:
        return []
    if budget <= NO_BUDGET:
        return [list(drawn)]
    groups, _ = length_batches(drawn, max_tokens=budget, max_rows=len(drawn), max_waste=None,
                               size=lambda d: d.tokens,
                               extra=lambda d: d.draft_positions(block_size))
    return groups


def label_weight(drawn: Sequence[Drawn], weights: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sum of slot weights over every label of the step (on ``weights``' device): the
    denominator of the one-batch loss, known before any feature is computed."""
    total = torch.zeros((), dtype=torch.float32)
    cpu_weights = weights.detach().float().cpu()
    for item in drawn:
        row = plain_row(item.row)
        _, valid = block_labels(torch.tensor(row.input_ids), torch.tensor(row.loss_mask),
                                item.anchors, block_size)
        total += (valid.float() * cpu_weights).sum()
    return total.to(weights.device)


def halved_budget(budget: int, drawn: Sequence[Drawn], step: int) -> int:
    """The budget a step retries at after running out of memory: half of it (or of the step's
    tokens, without one); the log says so."""
    half = max(1, (budget or sum(d.tokens for d in drawn)) // 2)
    log.warning("step %d: out of memory at a budget of %s tokens; retrying the step once at %d "
                "tokens", step, budget or "no", half)
    return half


@dataclass
class Accumulated:
    """What a step's micro-batches add up to: loss numerator, slot counts and sizes."""

    loss_sum: torch.Tensor | None = None
    per_slot: torch.Tensor | None = None
    rows: int = 0
    blocks: int = 0
    tokens: int = 0

    def add(self, loss_sum: torch.Tensor, per_slot: torch.Tensor, batch: Any) -> None:
        loss_sum = loss_sum.detach()
        self.loss_sum = loss_sum if self.loss_sum is None else self.loss_sum + loss_sum
        self.per_slot = per_slot if self.per_slot is None else self.per_slot + per_slot
        self.rows += batch.rows
        self.blocks += batch.blocks
        self.tokens += batch.tokens
