"""The held-out split: the samples with the smallest id hashes, never trained on.

``enqueue`` picks them while it streams the input (:class:`HeldoutPicker`: a fixed fraction, by
default 1%, but at least ``minimum`` rows) and freezes the choice, with each id's input shard, in
the input manifest; the rule itself (fraction, minimum) is frozen in ``run.json``. The train
worker never trains on them, ``eval-drafter`` and the trainer's periodic eval decode them, and
``export-dataset --split-heldout`` puts them in the heldout split. Deterministic and order-free:
the same ids are held out whatever order the input comes in.
"""

from __future__ import annotations

import hashlib
import heapq

HELDOUT_FRACTION = 0.01
HELDOUT_MIN = 16
_BUCKETS = 10_000


def _rank(sample_id: str) -> tuple[int, int]:
    """The order ids are held out in: bucket first (the fraction rule), then the full hash."""
    digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    value = int.from_bytes(digest, "big")
    return value % _BUCKETS, value


def is_heldout(sample_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """The fraction rule alone (runs enqueued before the split was frozen in the manifest)."""
    return _rank(sample_id)[0] < round(fraction * _BUCKETS)


class HeldoutPicker:
    """Streams ``(id, shard)`` pairs; keeps the fraction's ids, topped up to ``minimum``."""

    def __init__(self, fraction: float = HELDOUT_FRACTION, minimum: int = HELDOUT_MIN) -> None:
        if not 0.0 <= fraction < 1.0 or minimum < 0:
            raise ValueError(f"held-out fraction must be in [0, 1) and minimum >= 0, "
                             f"not {fraction} and {minimum}")
        self.fraction, self.minimum = fraction, minimum
        self.chosen: list[tuple[str, int]] = []
        # The ``minimum`` lowest-ranked others, as a max-heap (negated ranks) to top up from.
        self._others: list[tuple[tuple[int, int], str, int]] = []
        self.seen = 0

    def add(self, sample_id: str, shard: int) -> None:
        self.seen += 1
        if is_heldout(sample_id, self.fraction):
            self.chosen.append((sample_id, shard))
            return
        bucket, value = _rank(sample_id)
        entry = ((-bucket, -value), sample_id, shard)
        if len(self._others) < self.minimum:
            heapq.heappush(self._others, entry)
        elif self._others and entry > self._others[0]:
            heapq.heapreplace(self._others, entry)

    def picked(self) -> list[list[str | int]]:
        """``[[id, shard], ...]`` in shard order: the fraction's ids, topped up to ``minimum``
        with the next-ranked ones, but never more than half of a small input."""
        picked = list(self.chosen)
        if len(picked) < self.minimum:
            others = sorted(self._others, reverse=True)
            room = min(self.minimum, max(len(picked), self.seen // 2)) - len(picked)
            picked += [(i, s) for _, i, s in others[:max(0, room)]]
        return [[sample_id, shard] for sample_id, shard in sorted(picked, key=lambda p: p[1])]
