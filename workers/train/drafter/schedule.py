"""The learning-rate schedule: linear warmup, then cosine decay to 0 exactly at ``total``.

A run's total is first an estimate (generation still running) and is revised as the data
becomes known. :meth:`Schedule.revise` keeps the factor continuous: the decay goes on from the
progress it had reached, now spread over the steps left to the new total. So a revision never
jumps the learning rate, the last step (``total - 1``) is the only one near 0 and no step runs
at 0. Without revisions the factor is the textbook warmup + cosine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Schedule:
    """Factor of the peak learning rate for each step (0-based); revisable without a jump."""

    warmup: int
    total: int
    since: int = 0        # the step the current decay segment starts at (a revision's)
    progress0: float = 0.0  # the cosine progress reached at ``since``

    def progress(self, step: int) -> float:
        """How far the cosine decay is at ``step``: 0 at its start, 1 at ``total``."""
        start = max(self.warmup, self.since)
        base = self.progress0 if self.since > self.warmup else 0.0
        span = max(1, self.total - start)
        return min(1.0, max(0.0, base + (step - start) / span * (1.0 - base)))

    def factor(self, step: int) -> float:
        """The learning rate of ``step`` as a share of the peak."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        return 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))

    def revise(self, total: int, step: int) -> bool:
        """Make ``total`` the schedule's end from ``step`` (the next step to run) on, with the
        factor at ``step`` unchanged; True when the total changed. It never ends before ``step``
        (the steps already taken)."""
        total = max(total, step)
        if total == self.total:
            return False
        if step > self.warmup:
            self.progress0, self.since = self.progress(step), step
        self.total = total
        return True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schedule:
        return cls(int(data["warmup"]), int(data["total"]), int(data.get("since", 0)),
                   float(data.get("progress0", 0.0)))
