"""The gate panels' figures from storage, when Redis has no live run monitor (gone or wiped).

The same reader as the monitor's own rebuild (:func:`common.monitor.judged_samples`, the pause
and resume records): every stored sample once, in the order the gates judged it. From it come
what the monitor would hold in Redis: the supervised-token histogram, the newest
``EXAMPLES`` rejected samples per reason and the rolling window (the newest ``pause_after``
outcomes since the last ``resume --accept-gates``). Parts are put-once, so the result is
reused until the set of stored parts changes.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.gates import GateConfig
from common.monitor import EXAMPLES, example, gate_events, judged_samples
from common.storage import Storage


@dataclass(frozen=True)
class StoredGates:
    """The monitor's figures as storage gives them."""

    histogram: Counter[int]
    examples: dict[str, list[dict[str, Any]]]
    window: dict[str, Any] | None


@dataclass
class GateSource:
    """One run's stored gate figures, read again only when new parts appear."""

    storage: Storage
    run: str
    _parts: frozenset[str] | None = None
    _last: StoredGates | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, gates: GateConfig) -> StoredGates:
        parts = frozenset(key for prefix in (keys.generated_prefix(self.run),
                                             keys.rejected_prefix(self.run))
                          for key in self.storage.list(prefix)
                          if keys.part_number(key) is not None)
        with self._lock:
            if self._last is None or parts != self._parts:
                self._last, self._parts = stored_gates(self.storage, self.run, gates), parts
            return self._last


def stored_gates(storage: Storage, run: str, gates: GateConfig) -> StoredGates:
    """Histogram, examples and window as :func:`common.monitor.rebuild` would put them back."""
    resumes = [record for kind, record in gate_events(storage, run) if kind == "resume"]
    size = int((resumes[-1] if resumes else {}).get("pause_after") or gates.pause_after)
    accepted_at = max((int(r.get("checked", 0)) for r in resumes if r.get("accepted")), default=0)
    samples, _ = judged_samples(storage, run)
    histogram = Counter(t for s in samples for t in s["quality"]["supervised_tokens"])
    examples: dict[str, list[dict[str, Any]]] = {}
    for sample in reversed(samples):  # newest first, as the monitor keeps them
        if not sample["quality"]["passed"]:
            for reason in sample["quality"]["reasons"]:
                shown = examples.setdefault(reason, [])
                if len(shown) < EXAMPLES:
                    shown.append(example(sample))
    recent = [0 if s["quality"]["passed"] else 1 for s in reversed(samples)]
    recent = recent[:max(min(size, len(samples) - accepted_at), 0)]
    window = None
    if recent:
        window = {"size": len(recent), "rejected": sum(recent),
                  "rate": round(sum(recent) / len(recent), 4)}
    return StoredGates(histogram, examples, window)
