"""Epochs over a run's data: how many, and the seeded order each one visits shards and rows in.

A run trains its drafter ``epochs`` times over the committed, accepted, not-held-out samples
(``enqueue --epochs``, frozen in run.json). Epoch 1 takes shards as generation commits them;
every later epoch visits the run's shards, and the rows of each shard, in an order seeded by
the run id and the epoch, the same in every process (the trainer, its data-parallel ranks,
the reconciler that heals a lost message), so a restart replays exactly the same order.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import TypeVar

RECIPE_EPOCHS = 10
"""The published DFlash recipe's epochs: SpecForge's DFlash training example runs
``--num-epochs 10``."""

T = TypeVar("T")


def _rng(*parts: object) -> random.Random:
    seed = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(seed[:8], "big"))


def shard_order(run: str, epoch: int, shards: Iterable[int]) -> list[int]:
    """The order epoch ``epoch`` (0-based) trains ``shards`` in: by number in the first (as
    generation commits them), a seeded permutation in every later one."""
    ordered = sorted(shards)
    if epoch > 0:
        _rng(run, "shards", epoch).shuffle(ordered)
    return ordered


def row_order(run: str, epoch: int, shard: int, rows: Sequence[T]) -> list[T]:
    """A shard's rows in the order epoch ``epoch`` trains them: as stored in the first, a
    seeded permutation (per run, epoch and shard) in every later one."""
    ordered = list(rows)
    if epoch > 0:
        _rng(run, "rows", epoch, shard).shuffle(ordered)
    return ordered
