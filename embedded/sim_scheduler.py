"""The simulator's clock: continuous batching of every running request, one step at a time.

Step time (the formula is in :mod:`embedded.simulator`'s docstring; with speculative decoding
the tokens a step verifies are ``S + 1`` per request, :mod:`embedded.sim_spec`)::

    step_ms = decode_base_ms + decode_per_req_ms * tokens + prefill_per_token_us / 1000 * P
              [+ S * draft_step_ms when a request is verified in the step]
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass, field

from embedded.sim_spec import SpecCounts, SpecModel


@dataclass
class LatencyModel:
    max_running: int = 64
    decode_base_ms: float = 2.0
    decode_per_req_ms: float = 0.05
    prefill_per_token_us: float = 20.0
    time_scale: float = 1.0
    spec: SpecModel | None = None

    def step_s(self, tokens: int, prefill_tokens: int, drafted: bool = False) -> float:
        """Wall seconds of one scheduler step over ``tokens`` decoded or verified tokens."""
        ms = (self.decode_base_ms + self.decode_per_req_ms * tokens
              + self.prefill_per_token_us * prefill_tokens / 1000)
        if drafted and self.spec is not None:
            ms += self.spec.draft_forwards * self.spec.draft_step_ms
        return ms * self.time_scale / 1000


@dataclass(eq=False)
class Job:
    prompt_len: int
    target: list[int]                  # the plain decode's ids: what the verify checks against
    done: asyncio.Future[None]
    rng: random.Random | None = None   # the request's own draws of drafts
    prefilled: bool = False
    spec: SpecCounts = field(default_factory=SpecCounts)
    out: list[int] = field(default_factory=list)   # the ids committed so far

    @property
    def remaining(self) -> int:
        return len(self.target) - len(self.out)


@dataclass
class Scheduler:
    """Continuous batching: one loop steps every running request; the rest wait in a queue."""

    model: LatencyModel
    queue: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("requests", "completed", "aborted", "max_running_seen", "generated_tokens",
         "prompt_tokens", "verify_steps", "verified_tokens"), 0))
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    by_rid: dict[str, Job] = field(default_factory=dict)

    # Timers fire late (epoll has 1 ms resolution): steps keep to a deadline and catch up, but
    # never by more than this, so a stalled process does not burst afterwards.
    MAX_LAG_S = 0.1

    async def run(self, prompt_len: int, target: list[int], rid: str | None = None,
                  rng: random.Random | None = None) -> Job:
        """Decode ``target``'s tokens for a prompt (through draft and verify steps with
        speculative decoding); the job holds what was committed (fewer if aborted) and its
        verify steps."""
        job = Job(prompt_len, target, asyncio.get_running_loop().create_future(), rng)
        if rid is not None:
            self.by_rid[rid] = job
        self.queue.append(job)
        self._wake.set()
        try:
            await job.done
        finally:
            self.by_rid.pop(rid, None)
        return job

    def abort(self, rid: str) -> None:
        """End one request now (SGLang's /abort_request); an unknown rid is ignored."""
        job = self.by_rid.get(rid)
        if job is not None and not job.done.done():
            job.done.set_result(None)   # the step loop drops it and counts it aborted

    def abort_all(self) -> None:
        """End every queued and running request now (on shutdown)."""
        for job in [*self.running, *self.queue]:
            if not job.done.done():
                job.done.set_result(None)
                self.stats["aborted"] += 1
        self.running, self.queue = [], deque()

    async def loop(self) -> None:
        """Step forever: admit up to the cap, sleep one step, emit each request's tokens."""
        clock = asyncio.get_running_loop()
        deadline = clock.time()
        spec = self.model.spec
        while True:
            if not self.running and not self.queue:
                self._wake.clear()
                await self._wake.wait()
                deadline = clock.time()
            prefill = 0
            while self.queue and len(self.running) < self.model.max_running:
                job = self.queue.popleft()
                if not job.done.done():  # the client may have gone away while queued
                    self.running.append(job)
                    prefill += job.prompt_len
            self.stats["prompt_tokens"] += prefill
            self.stats["max_running_seen"] = max(self.stats["max_running_seen"],
                                                 len(self.running))
            verifying = sum(1 for job in self.running if job.prefilled) if spec else 0
            tokens = len(self.running) + verifying * (spec.steps if spec else 0)
            deadline += self.model.step_s(tokens, prefill, drafted=verifying > 0)
            lag = clock.time() - deadline
            if lag > self.MAX_LAG_S:
                deadline += lag
            await asyncio.sleep(max(0.0, -lag))
            self._emit()

    def _tokens(self, job: Job) -> list[int]:
        """Tokens ``job`` commits this step: one from its prefill (or a plain decode step),
        else what its verify step accepts."""
        spec, at = self.model.spec, len(job.out)
        if spec is None or not job.prefilled:
            job.prefilled = True
            return job.target[at:at + 1]
        committed = spec.step(job.rng or random.Random(0), job.target, at)[:job.remaining]
        job.spec.add(len(committed), spec.steps)
        self.stats["verify_steps"] += 1
        self.stats["verified_tokens"] += len(committed)
        return committed

    def _emit(self) -> None:
        still = []
        for job in self.running:
            if job.done.done():
                self.stats["aborted"] += 1
                continue
            if job.remaining > 0:
                committed = self._tokens(job)
                job.out += committed
                self.stats["generated_tokens"] += len(committed)
            if job.remaining == 0:
                job.done.set_result(None)
                self.stats["completed"] += 1
            else:
                still.append(job)
        self.running = still
