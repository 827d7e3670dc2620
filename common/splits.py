"""The held-out split: a fixed fraction of a run's samples, chosen by a hash of the sample id.

Deterministic and order-free: the same id is held out in every export, eval and training run.
"""

from __future__ import annotations

import hashlib

HELDOUT_FRACTION = 0.01
_BUCKETS = 10_000


def is_heldout(sample_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _BUCKETS < round(fraction * _BUCKETS)
