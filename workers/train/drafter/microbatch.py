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
from dataclasses import dataclass, field
from typing import Any

import torch

from common.errors import NothingToTrain
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
    log.warning("step %d: out of memory at a budget of %s tokens; retrying the step at %d "
                "tokens with activation checkpointing on (kept for the rest of the shard)",
                step, budget or "no", half)
    return half


@dataclass
class OutOfMemory:
    """A trainer's answer to running out of memory, the same for one rank and a group: retry
    the step at half the budget with checkpointing on (both kept until :meth:`restore`, at the
    next shard); a row that fails alone and checkpointed twice in a step is set aside. Each
    retry halves the budget, marks a row or drops one, so a step retries a bounded number of
    times."""

    budget: int = NO_BUDGET     # the configured budget, restored at each shard
    current: int = NO_BUDGET    # the budget in force
    recompute: bool = False     # checkpointing forced on by an earlier out-of-memory step
    retries: int = 0            # this step's retries
    set_aside: int = 0          # this step's rows set aside
    alone: set[int] = field(default_factory=set)   # rows that failed alone in this step

    def configure(self, budget: int) -> None:
        self.budget = self.current = budget

    def restore(self) -> None:
        """A new shard: the configured budget and checkpointing as the plan says again."""
        if self.current != self.budget or self.recompute:
            log.info("back to the configured budget of %s tokens", self.budget or "no")
        self.current, self.recompute = self.budget, False

    def new_step(self) -> None:
        self.retries = self.set_aside = 0
        self.alone.clear()

    def retry(self, drawn: list[Drawn], failed: Sequence[Drawn] | None,
              step: int) -> list[Drawn]:
        """The rows the step retries with, after one of its micro-batches (``failed``; None:
        unknown) ran out of memory. Raises NothingToTrain where no row is left to train."""
        self.retries += 1
        if failed is None and self.recompute and self.current == 1:
            raise NothingToTrain(f"step {step}: out of memory with every row alone")
        if failed is not None and len(failed) == 1 and self.recompute:
            row = failed[0]
            if id(row) not in self.alone:   # once more: the failure may have been transient
                self.alone.add(id(row))
                self.current = halved_budget(self.current, drawn, step)
                return drawn
            self.set_aside += 1
            log.warning("step %d: a row of %d tokens ran out of memory alone with activation "
                        "checkpointing on: set aside", step, row.tokens)
            left = [d for d in drawn if d is not row]
            if not left:
                raise NothingToTrain(f"step {step}: every row ran out of memory alone")
            return left
        self.current = halved_budget(self.current, drawn, step)
        self.recompute = True
        return drawn


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
