"""The ``queued`` registry's values: what holds a shard and since (or until) when.

A marker is ``<kind> <epoch>`` (the kinds are explained in :mod:`common.queue.dispatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUED, RETRY, STARTED = "queued", "retry", "started"


def marker(kind: str, at: float) -> str:
    """The ``queued`` hash value for a shard: what holds it and since (or until) when."""
    return f"{kind} {at:.3f}"


@dataclass(frozen=True)
class Marker:
    """A parsed ``queued`` value."""

    kind: str
    at: float

    @classmethod
    def parse(cls, value: str | None) -> Marker | None:
        if not value:
            return None
        kind, _, at = value.partition(" ")
        try:
            return cls(kind, float(at))
        except ValueError:
            # Not a marker this release writes (a hand edit): only the queue can vouch for it.
            return cls(QUEUED, 0.0)

    def holds(self, now: float, lease_ttl: float, in_queue: bool | None,
              run_lease_live: bool = False) -> bool:
        """Whether a message (or a starting delivery) still stands behind this marker.

        ``in_queue``: the message was seen in the queue, not seen, or None (queue not read).
        ``run_lease_live``: a one-per-run stage's lease is held, so a retry waiting for it is
        due only once its trainer lets go (its worker's pool may be busy with that very shard).
        """
        if self.kind == RETRY:
            return now < self.at + lease_ttl or run_lease_live
        if self.kind == STARTED:
            return now < self.at + 2 * lease_ttl
        return now < self.at + lease_ttl or in_queue is not False
