"""Hostile inputs to issue 66's MTP choice: settings that are no number, a stored verdict or
status record whose integer overflows a float, a bench verdict with a zero rate, and a worker's
measurement window that spans an engine relaunch into the other configuration.

Real components throughout: settings as ``load_settings`` reads them, verdicts through local
storage, the status record through a real redis-server, and the worker's
:class:`GenerateContext` with the SGLang-protocol simulator as its engine; the measurement's
clock is the test's, so which window a sample falls in is decided by the code, never by timing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import redis

from common import keys
from common.config import load_settings
from common.engine.engine_identity import EngineIdentity
from common.engine.speculative import choices_by_worker
from common.errors import ConfigError
from common.queue import redis_keys
from common.runs.bench_verdict import Decider, read_verdict
from common.runs.records import RunConfig
from common.storage import open_storage
from tests.conftest import HYBRID, RedisServer, TinyTarget, wait_until
from tests.test_mtp_switch import DEADLINE, DWELL, Clock, Shard, _context

BIG = "1" + "0" * 400   # an integer no float holds
DECIDER = Decider("cpu", 1, "abcd1234", EngineIdentity("m", "none", "3.12"))


@pytest.mark.parametrize("name", ["MTP_SWITCH_DWELL", "MTP_MEASURE_WINDOW", "MTP_MARGIN"])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_settings_refuse_what_is_no_finite_number(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match="finite"):
        load_settings({f"DFLASH_{name}": raw})
    # A click FloatRange (bench's --mtp-margin, its variable too) lets NaN through to here.
    with pytest.raises(ConfigError, match="finite"):
        load_settings({}, **{name.lower(): float(raw)})
    assert load_settings({}).replace(mtp_margin=0.1).generate.mtp_margin == 0.1


def _verdict_body(on_rate: str, off_rate: str) -> bytes:
    """A verdict record at concurrency 4 whose stamp holds a lone surrogate (orjson refuses it,
    so the standard parser reads the rest)."""
    rows = ",".join(f'{{"mtp":"{m}","concurrency":4,"output_tokens_per_s":{r},'
                    f'"steady":true,"window_rates":[{r},{r}]}}'
                    for m, r in (("on", on_rate), ("off", off_rate)))
    return ('{"stamp":"s\\ud800","run":"r","gpu":"cpu","tp":1,"engine":"abcd1234","rows":['
            + rows + "]}").encode()


def test_a_verdict_whose_rate_overflows_a_float_is_foreign(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.put_once(keys.bench_verdict("r", DECIDER.key, "s1"), _verdict_body(BIG, "100"))
    assert read_verdict(storage, "r", DECIDER) is None   # not followed, nor a crash at .at()
    storage.put_once(keys.bench_verdict("big", DECIDER.key, "s1"), _verdict_body("1e30", "1"))
    verdict = read_verdict(storage, "big", DECIDER)   # past 64 bits a float, as orjson reads
    assert verdict is not None
    pick = verdict.at(4)
    assert pick is not None and pick.on and pick.clear


def test_a_zero_off_rate_still_says_the_bench(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.put_once(keys.bench_verdict("r", DECIDER.key, "s1"), _verdict_body("5", "0"))
    verdict = read_verdict(storage, "r", DECIDER)
    assert verdict is not None
    pick = verdict.at(0)   # an in-flight of 0 takes the nearest level
    assert pick is not None and pick.concurrency == 4
    assert pick.line().startswith("bench s\ud800 at concurrency 4: mtp on 5.0 vs off 0.0")


def test_a_status_record_whose_rate_overflows_a_float_is_left_out(
        redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    body = ('{"x":"\\ud800","mtp":"on","source":"measured","rates":{"on":' + BIG
            + ',"off":1}}')
    client.hset(redis_keys.RunKeys("r").mtp, mapping={"w1": body, "w2": json.dumps(
        {"mtp": "off", "mode": "auto", "reason": "x", "source": "bench",
         "rates": {"on": 1, "off": 2}}), "w3": json.dumps({"mtp": "on", "mode": "auto"})})
    found = choices_by_worker(client.hgetall(redis_keys.RunKeys("r").mtp))
    assert list(found) == ["w2", "w3"] and found["w2"]["rates"] == {"on": 1.0, "off": 2.0}
    assert found["w2"]["source"] == "bench" and found["w3"]["source"] is None   # an older worker
    assert json.loads(json.dumps(found)) == found


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_a_measurement_window_reopens_after_the_engine_ran_the_other_configuration(
        target_model: TinyTarget, model_cache: Path, redis_server: RedisServer,
        tmp_path: Path) -> None:
    clock = Clock()
    gen, configs = _context(target_model, model_cache, redis_server, tmp_path, clock)
    configs["x"] = RunConfig(run="x", model=target_model.name, input="in.jsonl")  # no verdict
    try:
        warm = gen.engine   # on: run x measures on first
        choice = gen.choice_for(configs["x"], "w1@test")
        assert choice.on and choice.rates is None and choice.source == "measured"
        gen.produced("x", warm, 50)      # opens x's window at 1000
        clock.now += 10
        gen.produced("x", warm, 100)
        # Run "slow" (its verdict: off) takes the engine; it is switched off and back for x.
        slow = Shard("slow").start(gen, configs)
        assert slow.entered.wait(DEADLINE) and not slow.engine.mtp.on
        x = Shard("x").start(gen, configs)
        slow.done()
        wait_until(lambda: gen._users == 0, DEADLINE, "the slow shard to finish")
        clock.now += DWELL
        assert x.entered.wait(DEADLINE) and x.engine.mtp.on and x.engine is not warm
        window = gen.worker.settings.generate.mtp_measure_window
        clock.now += 1
        gen.produced("x", x.engine, 100)   # the first on the new engine: the window reopens
        clock.now += window
        gen.produced("x", x.engine, 360)
        x.done()
        measure = gen._measures["x"]
        assert measure.rates[True] == pytest.approx(360 / window)   # not diluted by off's time
        assert not math.isnan(measure.rates[True])
    finally:
        gen.close_engine()
