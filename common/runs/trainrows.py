"""Training rows and loss masks from generated samples: one row per regenerated assistant turn.

A row's ``input_ids`` are that turn's ``prompt_ids + output_ids`` exactly as the engine saw and
produced them (never re-tokenized), and ``loss_mask`` is 1 over every generated token (thinking
and the end-of-turn token included) and 0 over the prompt. Multi-turn history is whatever the
chat template rendered for that turn's request: Qwen3-style templates drop the reasoning of
earlier assistant turns, so each turn is its own row (its history is shown without thinking, as
at inference time) rather than one long sequence that the model never sees when serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TrainingRow:
    """One supervised sequence: the prompt as rendered plus the target's own tokens."""

    sample_id: str
    turn: int
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def supervised_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids) - self.supervised_tokens


def has_token_ids(sample: Mapping[str, Any]) -> bool:
    """Whether a sample records the token ids its rows are made of (a part's schema lets one
    hold its messages only: such a sample trains nothing)."""
    return bool(sample.get("turns")) or ("prompt_ids" in sample and "output_ids" in sample)


def turns_of(sample: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A sample's per-turn request records (single-turn records carry one)."""
    turns: list[dict[str, Any]] | None = sample.get("turns")
    if turns:
        return turns
    return [{"prompt_ids": sample["prompt_ids"], "output_ids": sample["output_ids"]}]


def training_rows(sample: Mapping[str, Any]) -> list[TrainingRow]:
    """One row per assistant turn of a generated sample."""
    rows = []
    for index, turn in enumerate(turns_of(sample)):
        prompt, output = list(turn["prompt_ids"]), list(turn["output_ids"])
        rows.append(TrainingRow(sample["id"], index, prompt + output,
                                [0] * len(prompt) + [1] * len(output)))
    return rows
