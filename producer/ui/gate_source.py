"""The gate panels' figures from storage, when Redis has no live run monitor (gone or wiped).

The same reader as the monitor's own rebuild (:mod:`common.monitor.rebuild`: every commit's
summary, the parts of uncommitted shards only, and the pause and resume records), so the panels
show what the monitor would hold in Redis: the supervised-token histogram, the newest
``EXAMPLES`` rejected samples per reason and the rolling window (the newest ``pause_after``
outcomes since the last ``resume --accept-gates``). Commits and parts are put-once, so the
result is reused until one listing pass finds a new one.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from common.gates.judge import GateConfig
from common.monitor.rebuild import shard_summaries, summary_index
from common.monitor.run_monitor import resume_state
from common.runs.index import ScanPlan, shard_total
from common.runs.schemas import GateExample
from common.runs.summary import RunSummary
from common.storage import Storage
from producer.status_record import GateWindow


@dataclass(frozen=True)
class StoredGates:
    """The monitor's figures as storage gives them."""

    histogram: Counter[int]
    examples: dict[str, list[GateExample]]
    window: GateWindow | None


@dataclass
class GateSource:
    """One run's stored gate figures, read again only when new commits or parts appear."""

    storage: Storage
    run: str
    _seen: frozenset[str] | None = None
    _last: StoredGates | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, gates: GateConfig) -> StoredGates:
        plan = summary_index(self.storage, self.run).plan(shard_total(self.storage, self.run))
        seen = plan.fingerprint()
        with self._lock:
            if self._last is None or seen != self._seen:
                self._last = stored_gates(self.storage, self.run, gates, plan)
                self._seen = seen
            return self._last


def stored_gates(storage: Storage, run: str, gates: GateConfig,
                 plan: ScanPlan | None = None) -> StoredGates:
    """Histogram, examples and window as :func:`common.monitor.run_monitor.rebuild` would put them
    back."""
    _, _, size, accepted_at = resume_state(storage, run, gates)
    total = RunSummary()
    for shard, summary, committed in shard_summaries(storage, run, plan=plan):
        total.add(shard, summary, committed)
    examples = {reason: [GateExample(id=view["id"], reasons=view["reasons"],   # EXAMPLE_FIELDS
                                     details=view["details"], answer=view["answer"])
                         for view in total.newest_examples(reason)]
                for reason in total.examples}
    recent = total.window(min(size, max(total.judged - accepted_at, 0)))
    window: GateWindow | None = None
    if recent:
        window = {"size": len(recent), "rejected": sum(recent),
                  "rate": round(sum(recent) / len(recent), 4)}
    return StoredGates(Counter(total.hist), examples, window)
