"""Per run, whether the worker's engine generates through the target's MTP head, and why.

A worker serves whatever runs its queue holds, so the choice is made at the first task of each
run (and kept for the worker's life), from what the worker can do (:class:`MtpWorker`), the
run's sampling, and the run's bench verdict for this worker's GPU model, TP and engine
arguments (:mod:`common.runs.bench_verdict`):

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
from collections.abc import Mapping

import redis

from common.choices import MtpMode
from common.engine.lossless import inexact, lossless_refusal
from common.engine.mtp import MtpChoice, MtpWorker
from common.engine.sampling import Sampling
from common.errors import ConfigError
from common.queue import redis_keys
from common.runs.bench_verdict import Verdict

log = logging.getLogger(__name__)


def decide(worker: MtpWorker, run: str, sampling: Sampling, verdict: Verdict | None,
           in_flight: int, engine_args: str, env: Mapping[str, str]) -> MtpChoice:
    """The run's configuration; ConfigError (the shard parks) for ``--mtp on`` where the
    run's sampling would not be kept."""
    if worker.user_algorithm is not None:
        choice = worker.turned(False, "")
        refusal = lossless_refusal(choice.algorithm, worker.device, sampling, engine_args, env)
        if refusal is not None:
            raise ConfigError(f"run {run}: {refusal}")
        return choice
    if worker.mode is MtpMode.OFF or not worker.can():
        return worker.start()
    refusal = lossless_refusal("NEXTN", worker.device, sampling, engine_args, env)
    if refusal is not None:
        if worker.mode is MtpMode.ON:
            raise ConfigError(f"run {run}: --mtp on: {refusal}")
        why = "; ".join(inexact("NEXTN", worker.device, sampling, engine_args, env))
        return worker.turned(False, f"the run's sampling is not kept exactly by SGLang's "
                                    f"speculative verify: {why}")
    if worker.mode is MtpMode.ON:
        return worker.turned(True, f"asked on: {worker.recipe()}")
    pick = verdict.at(in_flight) if verdict is not None else None
    if pick is None:
        start = worker.start()
        return worker.turned(start.on, f"no bench: {start.reason}")
    verb = "faster" if pick.on else "not faster"
    return worker.turned(pick.on, f"{pick.line()}: mtp on is {verb} at --max-in-flight "
                                  f"{in_flight}" + (f" ({worker.recipe()})" if pick.on else ""))


def record_choice(client: redis.Redis, run: str, worker: str, choice: MtpChoice) -> None:
    """The run's choice on this worker, for ``status`` (advisory: Redis may fail)."""
    try:
        client.hset(redis_keys.redis_mtp(run), worker,
                    json.dumps({"mtp": "on" if choice.on else "off", "mode": choice.mode,
                                "reason": choice.reason}))
    except redis.RedisError as err:
        log.warning("run %s: the MTP choice was not recorded: %s", run, err)

