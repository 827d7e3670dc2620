"""Per run, whether the worker's engine generates through the target's MTP head, and why.

A worker serves whatever runs its queue holds, so the choice is made at each shard's start by
:func:`common.engine.mtp.decide_mtp`, the decision ``bench --run`` asks too: from what the
worker can do (:class:`MtpWorker`), the run's sampling, and the run's bench verdict for this
worker's GPU model, TP, engine arguments, model, SGLang and Python
(:mod:`common.runs.bench_verdict`):

- ``off``: off. The user's own ``--speculative-algorithm``: as given, refused if not lossless.
- a sampling the verify does not keep exactly (:mod:`common.engine.lossless`: min-p, penalties,
  a sampled run where the verify commits the argmax): ``on`` parks the run's shards with the
  reason naming the parameter; ``auto`` generates the run without speculative decoding.
- ``on``: on. ``auto``: the verdict at the measured concurrency nearest ``--max-in-flight``;
  without one, the worker measures on and off on the run's own shards and keeps the faster
  (:mod:`common.engine.mtp_measure`). A verdict stored later is found at a shard's start: the
  run's verdicts are listed again once the last listing is older than :data:`LISTING_TTL` (or
  the measurement window, if shorter); one measured with another model, SGLang or Python is
  stale, ignored and said so.

The choice's line is logged when it changes and stored for ``status`` (:func:`record_choice`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from common import keys
from common.engine.mtp import MtpChoice
from common.queue.run_records import RunRecords
from common.runs.bench_verdict import Decider, Verdict, read_verdict
from common.storage import Storage

log = logging.getLogger(__name__)

LISTING_TTL = 60.0   # seconds a listing of a run's verdicts is kept


def record_choice(client: redis.Redis, run: str, worker: str, choice: MtpChoice) -> None:
    """The run's choice on this worker, for ``status`` (advisory: Redis may fail)."""
    try:
        RunRecords(client, run).record_mtp(
            worker, {"mtp": "on" if choice.on else "off", "mode": choice.mode,
                     "reason": choice.reason, "source": choice.source,
                     "rates": dict(choice.rates) if choice.rates else None})
    except redis.RedisError as err:
        log.warning("run %s: the MTP choice was not recorded: %s", run, err)


class VerdictListing:
    """The run's verdict for this worker's decider, listed at most once per ``ttl`` seconds;
    a stale one (same GPU, TP and engine flags, another identity) is logged once and ignored."""

    def __init__(self, storage: Storage, decider: Decider, ttl: float,
                 clock: Callable[[], float]) -> None:
        self.storage, self.decider, self.ttl, self.clock = storage, decider, ttl, clock
        self._read: dict[str, tuple[float, Verdict | None]] = {}
        self._told: set[tuple[str, str]] = set()

    def verdict(self, run: str) -> Verdict | None:
        now = self.clock()
        read = self._read.get(run)
        if read is not None and now - read[0] < self.ttl:
            return read[1]
        verdict = self._list(run)
        self._read[run] = (now, verdict)
        return verdict

    def _list(self, run: str) -> Verdict | None:
        areas = {k.area for o in self.storage.list_objects(keys.bench_prefix(run))
                 if (k := keys.parse(o.key)) is not None and k.kind is keys.KeyKind.BENCH}
        mine, hardware = self.decider.key, self.decider.hardware
        for area in sorted(areas - {mine}):
            if (area == hardware or area.startswith(hardware + "-")) \
                    and (run, area) not in self._told:
                self._told.add((run, area))
                ident = self.decider.identity
                log.warning("run %s: bench verdict %s is stale: measured with another model, "
                            "SGLang or Python than this worker's (%s: %s); ignored", run, area,
                            mine, ident.line() if ident is not None else "?")
        return read_verdict(self.storage, run, self.decider) if mine in areas else None
