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


def failed_part(failed: RankFailed, parts: list[list[list[Drawn]]],
                real: list[int]) -> list[Drawn] | None:
    """The micro-batch that ran out of memory (rank 0's view: ``parts[rank]`` lists each
    rank's, the first ``real[rank]`` of them real), None where unknown or a stand-in (whose row
    is another's: no row is blamed); raises ``failed`` again where a failure was not memory."""
    failures = [f for f in failed.failures if isinstance(f, Failure)]
    if not failures or not all(f.out_of_memory for f in failures):
        raise failed
    first = failures[0]
    if not 0 <= first.rank < len(parts) or not 0 <= first.part < real[first.rank]:
        return None
    return parts[first.rank][first.part]
