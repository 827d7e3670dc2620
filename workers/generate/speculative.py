"""The generate worker's side of speculative decoding (MTP): lossless or refused, and seen.

A shard of a run whose sampling the engine's verify would change (:func:`common.engine.lossless.
lossless_refusal`: the user's own algorithm, or a server's at ``--engine-url``) is parked with
that reason before any request is sent; the worker's own MTP choice is made per run
(:mod:`workers.generate.mtp_run`). Each written part adds its turns' verify steps and tokens to
the run's Redis figures under this worker's name (``status`` shows algorithm and mean accept
length) and to the worker's Prometheus metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import redis

from common.engine.lossless import lossless_refusal
from common.engine.sampling import Sampling
from common.engine.speculative import sample_totals
from common.errors import ConfigError
from common.queue.run_records import RunRecords
from workers.generate import metrics
from workers.generate.engines.base import Engine

log = logging.getLogger(__name__)

_totals: dict[str, list[int]] = {}   # run -> [verify steps, tokens] written by this process
_lock = threading.Lock()


def check_lossless(engine: Engine, sampling: Sampling, run: str) -> None:
    """Refuse (park the shard) where the engine's speculative verify would change ``sampling``."""
    mtp = engine.mtp
    if mtp is None:
        return
    refusal = lossless_refusal(engine.algorithm, mtp.device, sampling)
    if refusal is not None:
        raise ConfigError(f"run {run}: {refusal}")


def record(client: redis.Redis, run: str, worker: str, algorithm: str | None,
           samples: Sequence[dict[str, Any]]) -> None:
    """Add the verified turns of ``samples`` to the run's figures (advisory: Redis may fail)."""
    steps, tokens = sample_totals(samples)
    if not steps:
        return
    with _lock:
        total = _totals.setdefault(run, [0, 0])
        total[0] += steps
        total[1] += tokens
        metrics.ACCEPT_LENGTH.labels(run).set(total[1] / total[0])
    metrics.SPEC_STEPS.labels(run).inc(steps)
    metrics.SPEC_TOKENS.labels(run).inc(tokens)
    if algorithm:
        metrics.ALGORITHM.labels(algorithm).set(1)
    try:
        RunRecords(client, run).add_speculative(worker, steps, tokens, algorithm)
    except redis.RedisError as err:
        log.warning("run %s: speculative figures not recorded: %s", run, err)
