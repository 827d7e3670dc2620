"""The generate stage's per-process state: the worker's context plus the engine, in one
configuration at a time.

One engine serves one configuration (MTP on or off); it is relaunched only to serve the
configuration it does not run (:meth:`GenerateContext.serving`). Tasks of the running
configuration take it at once. A task whose run needs the other waits; the switch is decided
when it has waited ``DFLASH_MTP_SWITCH_DWELL`` seconds counted from its arrival or the engine's
last launch (at once when the engine has served nothing since its launch), so runs alternating
in the queue do not flip it back and forth. From then new tasks of the running configuration
wait behind it (it is never starved); once the engine's tasks finish, it is stopped and started
in the other configuration. The wait holds the shard's lease, so no other worker takes it.
Under ``--mtp auto`` each task's run is decided again at its start (:mod:`.mtp_run`): a bench
verdict found since is followed; without one, the run's samples feed this worker's measurement
of on and off (:meth:`GenerateContext.produced`), whose standing is the choice.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis

from common.choices import EngineKind, MtpMode, MtpSource
from common.config import Settings
from common.engine.models import resolve_model_path, stop_token_ids
from common.engine.mtp import MtpChoice, MtpWorker, decide_mtp, target_shape
from common.engine.mtp_measure import Measurement
from common.gates.judge import TokenInfo
from common.queue.run_records import publish_engine
from common.runs.bench_verdict import Decider
from common.runs.records import RunConfig
from workers.context import WorkerContext, get_context
from workers.generate.engines.base import Engine, EngineLoop
from workers.generate.engines.cpu import CpuEngine
from workers.generate.mtp_run import LISTING_TTL, VerdictListing, record_choice

log = logging.getLogger(__name__)

SWITCH_POLL = 1.0   # seconds a waiting task sleeps between looks at its dwell (or until woken)


def build_engine(settings: Settings, mtp: MtpChoice) -> Engine:
    """The worker's engine in configuration ``mtp``: in-process CPU model, or an SGLang server
    (started with the MTP flags where ``mtp.on``, or given)."""
    model_path, gen = resolve_model_path(settings), settings.generate
    if gen.engine is EngineKind.CPU:
        cpu = CpuEngine(model_path, batch_size=gen.batch_size)
        cpu.mtp = mtp
        return cpu
    from transformers import AutoTokenizer

    from workers.generate.engines.server import EngineServer, server_command
    from workers.generate.engines.sglang import SglangEngine

    server = None
    url = gen.engine_url
    if not url:
        url = f"http://127.0.0.1:{settings.engine_server_port}"
        server = EngineServer(server_command(settings, model_path, mtp.args), url,
                              settings.engines_dir, gen.engine_startup_timeout,
                              gen.engine_drain_timeout)
        server.start()
    return SglangEngine(url, AutoTokenizer.from_pretrained(model_path), gen.max_in_flight,
                        gen.request_timeout, retry_window=gen.engine_startup_timeout,
                        stop_ids=stop_token_ids(model_path), server=server, mtp=mtp)


LOAD_WEIGHT = 0.05   # a finished sample's weight in the moving mean of requests in flight


@dataclass
class GenerateContext:
    """The process's :class:`WorkerContext` (settings, storage, Redis, stopping) and its engine."""

    worker: WorkerContext
    _engine: Engine | None = None
    _users: int = 0                    # tasks generating on the engine now
    _served: int = 0                   # tasks the engine has taken since its launch
    _launched: float = 0.0             # when it was launched (``clock``)
    _switch: bool | None = None        # the configuration a decided switch goes to (mtp on)
    _waiting: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _runs: dict[str, MtpChoice] = field(default_factory=dict)
    _measures: dict[str, Measurement] = field(default_factory=dict)
    _deciding: threading.Lock = field(default_factory=threading.Lock)
    _load: float | None = None         # requests in flight, a moving mean over samples
    loop: EngineLoop = field(default_factory=EngineLoop)
    clock: Callable[[], float] = time.monotonic

    @cached_property
    def mtp(self) -> MtpWorker:
        """What this worker can do with the MTP head (from its settings and the target)."""
        settings = self.worker.settings
        return MtpWorker.of(settings, target_shape(resolve_model_path(settings)))

    @cached_property
    def decider(self) -> Decider:
        settings = self.worker.settings
        return Decider.of(settings, settings.worker.gpu, dict(os.environ))

    @cached_property
    def verdicts(self) -> VerdictListing:
        """The runs' bench verdicts for this worker, listed again after a short while."""
        window = self.worker.settings.generate.mtp_measure_window
        return VerdictListing(self.worker.storage, self.decider, min(LISTING_TTL, window),
                              self.clock)

    def close_engine(self) -> None:
        with self._cond:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    @property
    def engine(self) -> Engine:
        """The engine as it runs now; built in the starting configuration when there is none."""
        with self._cond:
            if self._engine is None:
                self._engine = build_engine(self.worker.settings, self.mtp.start())
            return self._engine

    @property
    def current(self) -> Engine | None:
        """The engine, if one runs (never waits: for metrics)."""
        return self._engine

    def choice_for(self, config: RunConfig, worker: str) -> MtpChoice:
        """The run's configuration on this worker, decided at each task's start (logged and
        stored for status when it changes); ConfigError where ``--mtp on`` cannot keep the
        run's sampling."""
        with self._deciding:   # two shards of a run at once: one decision, one line
            choice = self._decided(config)
            if self._runs.get(config.run) != choice:
                log.info("run %s: %s", config.run, choice.line())
                record_choice(self.worker.redis, config.run, worker, choice)
                self._runs[config.run] = choice
            return choice

    def _decided(self, config: RunConfig) -> MtpChoice:
        """The decision now: the run's verdict (listed again after a while), else where this
        worker's own measurement of the run stands."""
        settings, run = self.worker.settings, config.run
        auto = self.mtp.mode is MtpMode.AUTO and self.mtp.can()
        verdict = self.verdicts.verdict(run) if auto else None
        measure, running = self._measures.get(run), self._running()
        if auto and measure is None:
            measure = self._measures[run] = Measurement(
                run, settings.generate.mtp_measure_window, True if running is None else running,
                settings.generate.mtp_margin)
        return decide_mtp(self.mtp, run, config.sampling, verdict,
                          self.in_flight(), settings.generate.engine_args,
                          os.environ, measure.view() if measure is not None else None, running)

    def in_flight(self) -> int:
        """The requests this worker really holds in flight (the engine's count as each sample
        finished, a moving mean), where a verdict's nearest level is taken; ``--max-in-flight``
        until a sample has finished."""
        cap = self.worker.settings.generate.max_in_flight
        return cap if self._load is None else min(max(round(self._load), 1), cap)

    def produced(self, run: str, engine: Engine, tokens: int) -> None:
        """Count a sample of ``run`` generated on ``engine`` into the worker's load and the
        run's measurement, while its choice is being measured."""
        now = engine.in_flight + 1   # itself, answered just now, included
        self._load = now if self._load is None else self._load + LOAD_WEIGHT * (now - self._load)
        choice, measure = self._runs.get(run), self._measures.get(run)
        if measure is None or choice is None or choice.rates is not None \
                or choice.source is not MtpSource.MEASURED:
            return
        on = engine.mtp is not None and engine.mtp.on
        if measure.add(on, tokens, self.clock(), self._launched):
            log.info("run %s: mtp %s measured at %.1f output tok/s on this worker", run,
                     "on" if on else "off", measure.rates[on])

    @contextmanager
    def serving(self, choice: MtpChoice) -> Iterator[Engine]:
        """The engine in ``choice``'s configuration, held until the block ends; switched to it
        where the dwell rule says so (the module's docstring)."""
        arrived = self.clock()
        with self._cond:
            self._waiting[choice.on] += 1
            try:
                while not self._admits(choice, arrived):
                    self._cond.wait(SWITCH_POLL)
            finally:
                self._waiting[choice.on] -= 1
                self._cond.notify_all()
            self._users += 1
            self._served += 1
            engine = self._engine
        assert engine is not None
        try:
            yield engine
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def _running(self) -> bool | None:
        """The configuration the engine runs (mtp on), None without an engine."""
        if self._engine is None:
            return None
        return self._engine.mtp is not None and self._engine.mtp.on

    def _admits(self, choice: MtpChoice, arrived: float) -> bool:
        """Whether a task of ``choice`` may generate now, the engine switched for it where the
        dwell rule says so (the lock held)."""
        running, switch = self._running(), self._switch
        if switch is not None and self._waiting[switch] == 0:   # its tasks are gone
            self._switch = switch = None
        if running is None or (switch == choice.on and self._users == 0):
            self._launch(choice)
            return True
        if running == choice.on:   # kept, unless a switch away is decided
            return switch is None
        waited = self.clock() - max(arrived, self._launched)
        dwell = self.worker.settings.generate.mtp_switch_dwell
        if switch is None and (self._served == 0 or waited >= dwell):
            self._switch = choice.on
            log.info("engine: switching to mtp %s once its %d task(s) finish: %s (waited %.0f "
                     "s, dwell %.0f s)", "on" if choice.on else "off", self._users,
                     choice.reason, waited, dwell)
            return self._admits(choice, arrived)
        return False

    def _launch(self, choice: MtpChoice) -> None:
        """Start the engine in ``choice``'s configuration, stopping the one running (the lock
        held, no task on it)."""
        if self._engine is not None:
            log.info("engine: relaunching with mtp %s (%s)", "on" if choice.on else "off",
                     choice.reason)
            self._engine.close()
            self._engine = None
        self._engine = build_engine(self.worker.settings, choice)
        self._launched, self._served, self._switch = self.clock(), 0, None
        self.__dict__.pop("tokens", None)
        announce_engine(self.worker, self._engine)

    @cached_property
    def tokens(self) -> TokenInfo:
        """Special and think-marker ids of the engine's tokenizer, for the quality gates."""
        return TokenInfo.of(self.engine.tokenizer)


_context: GenerateContext | None = None
_lock = threading.Lock()


def get_generate_context() -> GenerateContext:
    """The process's generate context, around the shared worker context (engine built lazily)."""
    global _context
    with _lock:
        if _context is None:
            _context = GenerateContext(get_context())
        return _context


def warm_engine(worker: str | None = None) -> None:
    """Build the engine now so the first shard does not pay for it (called at worker start);
    ``worker`` is the Celery node name the engine is announced under."""
    context = get_generate_context()
    announce_engine(context.worker, context.engine, worker)


def announce_engine(context: WorkerContext, engine: Engine, worker: str | None = None) -> None:
    """Tell ``status`` where this worker's engine server and its log are (advisory), which
    worker owns it and its speculative algorithm (the dashboard's Engines panel)."""
    server, url = engine.server, engine.url
    if url is None:  # the in-process CPU engine has no server to show
        return
    record: dict[str, Any] = ({"url": server.url, "log": str(server.log_path),
                               "pid": server.proc.pid if server.proc else None}
                              if server is not None else {"url": url, "log": None, "pid": None})
    record.update(worker=worker or _announced.get("worker"),
                  algorithm=engine.algorithm)
    _announced["worker"] = record["worker"]
    try:
        publish_engine(context.redis, f"{socket.gethostname()}:gpu{context.settings.worker.gpu}",
                       record)
    except redis.RedisError as err:
        log.warning("engine location not published: %s", err)


_announced: dict[str, str | None] = {}   # the worker name the engine was first announced under
