"""Per run, whether the worker's engine generates through the target's MTP head, and why.

A worker serves whatever runs its queue holds, so the choice is made at the first task of each
run (and kept for the worker's life) by :func:`common.engine.mtp.decide_mtp`, the decision
``bench --run`` asks too: from what the worker can do (:class:`MtpWorker`), the run's sampling,
and the run's bench verdict for this worker's GPU model, TP and engine arguments
(:mod:`common.runs.bench_verdict`):

- ``off``: off. The user's own ``--speculative-algorithm``: as given, refused if not lossless.
- a sampling the verify does not keep exactly (:mod:`common.engine.lossless`: min-p, penalties,
  a sampled run where the verify commits the argmax): ``on`` parks the run's shards with the
  reason naming the parameter; ``auto`` generates the run without speculative decoding.
- ``on``: on. ``auto``: the verdict at the measured concurrency nearest ``--max-in-flight``;
  without one, on where a head is stated and SGLang's verify samples (``no bench``).

The choice's line is logged once per run and stored for ``status`` (:func:`record_choice`).
"""

from __future__ import annotations

import json
import logging

import redis

from common.engine.mtp import MtpChoice
from common.queue import redis_keys

log = logging.getLogger(__name__)


def record_choice(client: redis.Redis, run: str, worker: str, choice: MtpChoice) -> None:
    """The run's choice on this worker, for ``status`` (advisory: Redis may fail)."""
    try:
        client.hset(redis_keys.redis_mtp(run), worker,
                    json.dumps({"mtp": "on" if choice.on else "off", "mode": choice.mode,
                                "reason": choice.reason, "source": choice.source}))
    except redis.RedisError as err:
        log.warning("run %s: the MTP choice was not recorded: %s", run, err)
