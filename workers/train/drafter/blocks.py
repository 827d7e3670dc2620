"""DFlash training blocks: anchor sampling, labels, slot weights and packing rows into one batch.

A block is ``[anchor token, MASK x (B-1)]`` placed at positions ``anchor .. anchor+B-1``; slot
``k`` is trained to predict ``input_ids[anchor + k]`` (no shift), for ``k = 1..B-1``. Slot 0 is
the given anchor and is never a label. Labels past the end of the row, or on positions outside
the loss mask (as SpecForge does; a no-op when the supervised span is a suffix, as in
:mod:`common.runs.trainrows`), are ignored. Slot ``k`` weighs ``exp(-(k-1)/gamma)``.

    anchors = sample_anchors(loss_mask, max_anchors=512, generator=g)
    labels, valid = block_labels(input_ids, loss_mask, anchors, block_size=16)
    batch = pack_rows(rows, features, anchor_lists, block_size=16, mask_token_id=m)

Rows are packed, not padded: the context is every row's tokens one after another, and each
block only sees its own row (``starts``), so no compute goes to padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.runs.trainrows import TrainingRow

IGNORE = -100


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Per-slot loss weights ``[B]``: 0 for the anchor slot, ``exp(-(k-1)/gamma)`` for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``a`` with ``loss_mask[a]`` and ``loss_mask[a+1]`` (the next token is trained)."""
    mask = loss_mask.bool()
    ok = mask[:-1] & mask[1:]
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Up to ``max_anchors`` distinct candidate positions, drawn with ``generator``, sorted."""
    candidates = anchor_candidates(loss_mask.cpu())
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[pick].sort().values
    return candidates


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[N, B]`` (``input_ids[a+k]``, IGNORE where unused) and their validity mask."""
    length = input_ids.shape[0]
    offsets = torch.arange(block_size, device=anchors.device)
    index = anchors.unsqueeze(1) + offsets
    in_range = index < length
    safe = index.clamp(max=length - 1)
    valid = in_range & loss_mask.bool()[safe] & (offsets > 0)
    labels = torch.where(valid, input_ids[safe], torch.full_like(safe, IGNORE))
    return labels, valid


@dataclass(frozen=True)
class PackedBatch:
    """One training step's drafter inputs: packed context, blocks, labels and weights."""

    features: torch.Tensor            # [S, K*H] target features of every packed row
    context_positions: torch.Tensor   # [S] position of each context token inside its row
    anchors: torch.Tensor             # [N] packed context index of each block's anchor
    starts: torch.Tensor              # [N] packed index where the anchor's row starts
    block_ids: torch.Tensor           # [N*B] anchor token then MASK ids
    block_positions: torch.Tensor     # [N*B] anchor position in its row + slot
    labels: torch.Tensor              # [N, B] IGNORE where unused
    valid: torch.Tensor               # [N, B] bool: slot carries a label
    rows: int
    tokens: int                       # context tokens (sum of row lengths)

    @property
    def blocks(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.labels.shape[1])

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with every tensor on ``device`` (non-blocking copies)."""
        moved = {name: getattr(self, name).to(device, non_blocking=True)
                 for name in ("features", "context_positions", "anchors", "starts", "block_ids",
                              "block_positions", "labels", "valid")}
        return PackedBatch(**moved, rows=self.rows, tokens=self.tokens)


def pack_rows(rows: Sequence[TrainingRow], features: Sequence[torch.Tensor],
              anchors: Sequence[torch.Tensor], block_size: int,
              mask_token_id: int) -> PackedBatch:
    """Pack rows with their features ``[T, K*H]`` and sampled anchors into one batch."""
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    offset = 0
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in (
        "positions", "anchors", "starts", "block_ids", "block_positions", "labels", "valid")}
    offsets = torch.arange(block_size)
    for row, feats, row_anchors in zip(rows, features, anchors, strict=True):
        ids = torch.tensor(row.input_ids, dtype=torch.long)
        mask = torch.tensor(row.loss_mask, dtype=torch.bool)
        if feats.shape[0] != ids.shape[0]:
            raise ValueError(f"row {row.sample_id}#{row.turn}: {ids.shape[0]} tokens but "
                             f"{feats.shape[0]} feature rows")
        labels, valid = block_labels(ids, mask, row_anchors, block_size)
        block = torch.full((row_anchors.shape[0], block_size), mask_token_id, dtype=torch.long)
        block[:, 0] = ids[row_anchors]
        parts["positions"].append(torch.arange(ids.shape[0]))
        parts["anchors"].append(row_anchors + offset)
        parts["starts"].append(torch.full_like(row_anchors, offset))
        parts["block_ids"].append(block.flatten())
        parts["block_positions"].append((row_anchors.unsqueeze(1) + offsets).flatten())
        parts["labels"].append(labels)
        parts["valid"].append(valid)
        offset += ids.shape[0]
    return PackedBatch(
        features=torch.cat(list(features)), context_positions=torch.cat(parts["positions"]),
        anchors=torch.cat(parts["anchors"]), starts=torch.cat(parts["starts"]),
        block_ids=torch.cat(parts["block_ids"]),
        block_positions=torch.cat(parts["block_positions"]),
        labels=torch.cat(parts["labels"]), valid=torch.cat(parts["valid"]),
        rows=len(rows), tokens=offset,
    )


def acceptance_length(slot_accuracy: Sequence[float]) -> float:
    """Expected tokens per verify step from per-slot accuracies: ``1 + sum_k prod_{j<=k} acc_j``.

    Slot ``k`` is accepted only if slots ``1..k`` all are; treating slots as independent, the
    chance of accepting at least ``k`` drafted tokens is the running product, and the target
    always adds one token of its own. An optimistic estimate (errors are correlated).
    """
    total, running = 1.0, 1.0
    for acc in slot_accuracy:
        running *= acc if math.isfinite(acc) else 0.0
        total += running
    return total
