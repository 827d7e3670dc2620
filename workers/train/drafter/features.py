"""Online target features: the frozen target's chosen layers over a batch of rows, never stored.

    rows = [FeaturedRow(row, feats) for row, feats in
            zip(batch, target_features(target, batch, drafter.config.target_layer_ids))]
    # or, in one call:
    rows = with_target_features(target, batch, drafter.config.target_layer_ids)
    metrics = trainer.step(rows)

Rows are right-padded into one forward pass (causal attention: padding after a row cannot change
its positions) that keeps only the K chosen layers and stops after the deepest
(:mod:`workers.capture`); layer ``i`` is HF ``hidden_states[i + 1]``. The trainer calls this
per micro-batch (:mod:`workers.batching`), so what a step holds is bounded by its token budget.
The target runs under ``torch.no_grad`` (not inference mode: the drafter's backward must be
able to save the features) in its own dtype, and the features stay in it: views cut back to
each row's length, on the target's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.runs.trainrows import TrainingRow
from workers.capture import LayerCapture
from workers.target_heads import target_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class FeaturedRow:
    """A training row with its target features ``[T, K*H]``."""

    row: TrainingRow
    features: torch.Tensor


TrainRow = TrainingRow | FeaturedRow   # a row with or without its features


def plain_row(row: TrainRow) -> TrainingRow:
    """The training row itself, with or without the target features computed for it."""
    return row if isinstance(row, TrainingRow) else row.row


@torch.no_grad()
def target_features(target: PreTrainedModel, rows: Sequence[TrainingRow],
                    layer_ids: Sequence[int], pad_id: int = 0) -> list[torch.Tensor]:
    """One ``[T_i, K*H]`` tensor per row: the target's layers ``layer_ids`` concatenated."""
    if not rows:
        return []
    device = target_device(target)
    lengths = [len(r.input_ids) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : lengths[i]] = torch.tensor(row.input_ids, dtype=torch.long)
        attention[i, : lengths[i]] = 1
    feats = LayerCapture(target, layer_ids).features(
        input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False)
    return [feats[i, :n] for i, n in enumerate(lengths)]


def with_target_features(target: PreTrainedModel, rows: Sequence[TrainingRow],
                         layer_ids: Sequence[int], pad_id: int = 0) -> list[FeaturedRow]:
    """``rows`` paired with their freshly computed target features."""
    feats = target_features(target, rows, layer_ids, pad_id)
    return [FeaturedRow(row, f) for row, f in zip(rows, feats, strict=True)]
