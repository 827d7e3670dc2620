"""What a training group's ranks share when one fails: who, where and whether it ran out of
memory, so that rank 0 retries an out-of-memory step and parks any other failure."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import RankFailed
from workers.train.drafter.microbatch import Drawn


@dataclass(frozen=True)
class Failure:
    """A rank's own failure as the group agrees on it: where (its micro-batch, -1: none) and
    whether it ran out of memory, which the group retries."""

    rank: int
    part: int
    out_of_memory: bool
    text: str

    def __str__(self) -> str:
        return self.text


def failed_part(failed: RankFailed, parts: list[list[list[Drawn]]]) -> list[Drawn] | None:
    """The micro-batch that ran out of memory (rank 0's view: ``parts[rank]`` lists each
    rank's), None where unknown; raises ``failed`` again where a failure was not memory."""
    failures = [f for f in failed.failures if isinstance(f, Failure)]
    if not failures or not all(f.out_of_memory for f in failures):
        raise failed
    first = failures[0]
    rank_parts = parts[first.rank] if first.rank < len(parts) else []
    return rank_parts[first.part] if 0 <= first.part < len(rank_parts) else None
