"""One worker serving two runs whose verdicts differ (issue 66): the engine is relaunched only to
serve the configuration it does not run, and only as the dwell rule allows.

A real :class:`GenerateContext` (settings, Redis, local storage, the bench verdicts each run
stores) starts the SGLang-protocol simulator through ``--engine-cmd`` as a worker does; the
shards are threads in ``serving``, held open until the test lets them go. The dwell's clock is
the test's, moved by hand, so which task may switch is decided by the rule, never by timing.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from common.config import load_settings
from common.runs.bench_verdict import write_verdict
from common.runs.records import RunConfig
from common.storage import open_storage
from tests.conftest import HYBRID, RedisServer, TinyTarget, free_port, wait_until
from workers.context import WorkerContext
from workers.generate.context import GenerateContext

SIM_CMD = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           "--model-path {model} {engine_args}")
DWELL = 600.0
DEADLINE = 120   # seconds for an engine to start and a thread to move (a hang, not a speed)


class Clock:
    """The dwell's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Shard:
    """One task of ``run`` generating on the context's engine until released."""

    run: str
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    engine: Any = None

    def start(self, gen: GenerateContext, configs: dict[str, RunConfig]) -> Shard:
        def work() -> None:
            choice = gen.choice_for(configs[self.run], "w1@test")
            with gen.serving(choice) as engine:
                self.engine = engine
                self.entered.set()
                self.release.wait(DEADLINE * 4)

        threading.Thread(target=work, name=f"shard-{self.run}", daemon=True).start()
        return self

    def done(self) -> None:
        self.release.set()


def _context(target: TinyTarget, cache: Path, redis_server: RedisServer, tmp_path: Path,
             clock: Clock) -> tuple[GenerateContext, dict[str, RunConfig]]:
    settings = load_settings({}, engine="sglang", engine_cmd=SIM_CMD, model=target.name,
                             cache_dir=cache, engine_dir=str(tmp_path / "engines"),
                             engine_port=free_port(), broker_url=redis_server.url,
                             storage=str(tmp_path / "storage"), mtp="auto", max_in_flight=4,
                             mtp_switch_dwell=DWELL)
    gen = GenerateContext(WorkerContext(settings), clock=clock)
    storage = open_storage(settings.broker.storage)
    configs = {}
    for run, (off, on) in {"fast": (100.0, 300.0), "slow": (300.0, 100.0)}.items():
        rows = [{"mtp": mode, "concurrency": 4, "output_tokens_per_s": rate, "steady": True,
                 "window_rates": [rate, rate]}
                for mode, rate in (("off", off), ("on", on))]
        assert write_verdict(storage, run, gen.decider, rows) is not None
        configs[run] = RunConfig(run=run, model=target.name, input="in.jsonl")
    return gen, configs


def _waiting(gen: GenerateContext, on: bool, count: int) -> None:
    wait_until(lambda: gen._waiting[on] == count, DEADLINE, f"{count} task(s) waiting for "
               f"mtp {'on' if on else 'off'}", interval=0.05)


@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)
def test_alternating_runs_switch_the_engine_only_as_the_dwell_allows(
        target_model: TinyTarget, model_cache: Path, redis_server: RedisServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.generate.context")
    clock = Clock()
    gen, configs = _context(target_model, model_cache, redis_server, tmp_path, clock)
    try:
        warm = gen.engine   # started in auto's rule before any run: on
        assert warm.mtp is not None and warm.mtp.on
        assert gen.choice_for(configs["fast"], "w1@test").on
        assert not gen.choice_for(configs["slow"], "w1@test").on
        # The warm engine served nothing: the first task of the other configuration switches.
        s1 = Shard("slow").start(gen, configs)
        assert s1.entered.wait(DEADLINE) and not s1.engine.mtp.on
        # A fast shard waits; slow shards keep the engine meanwhile, before and after the
        # engine drains, until the fast one has waited the dwell.
        f1 = Shard("fast").start(gen, configs)
        _waiting(gen, True, 1)
        s2 = Shard("slow").start(gen, configs)
        assert s2.entered.wait(DEADLINE) and s2.engine is s1.engine
        s1.done()
        s2.done()
        s3 = Shard("slow").start(gen, configs)
        assert s3.entered.wait(DEADLINE) and s3.engine is s1.engine
        assert not f1.entered.is_set()
        # Past the dwell the fast shard gets the switch: new slow shards wait behind it.
        clock.now += DWELL
        wait_until(lambda: "switching to mtp on" in caplog.text, DEADLINE, "the switch")
        s4 = Shard("slow").start(gen, configs)
        _waiting(gen, False, 1)
        s3.done()
        assert f1.entered.wait(DEADLINE) and f1.engine.mtp.on
        f2 = Shard("fast").start(gen, configs)
        assert f2.entered.wait(DEADLINE) and f2.engine is f1.engine
        assert not s4.entered.is_set()
        f1.done()
        f2.done()
        wait_until(lambda: gen._users == 0, DEADLINE, "the fast shards to finish")
        clock.now += DWELL   # the slow shard, waiting since the relaunch, gets it back
        assert s4.entered.wait(DEADLINE) and not s4.engine.mtp.on
        s4.done()
        engines = [warm, s1.engine, f1.engine, s4.engine]
        assert len({id(e) for e in engines}) == 4   # each relaunch a new engine
        assert [e.mtp.on for e in engines] == [True, False, True, False]
        relaunches = [r.getMessage() for r in caplog.records
                      if r.getMessage().startswith("engine: relaunching")]
        assert [line.split()[4] for line in relaunches] == ["off", "on", "off"], relaunches
    finally:
        gen.close_engine()
