"""``dflash-pipeline bench``: throughput of an SGLang-protocol server at several concurrencies.

The seed's "benchmark throughput on 1 GPU" before a long run: for each concurrency, a closed
loop keeps that many ``/generate`` requests in flight (a finished one is followed at once by the
next) until ``--num`` have finished, then reports output tokens/s over the steady window
(:func:`steady_row`), requests/s and latency percentiles, the engine's accept length where it
decodes speculatively (SGLang's ``spec_verify_ct``: output tokens / verify steps), and the best
setting. Synthetic prompts here; ``bench --run`` (:mod:`producer.bench_loop`) runs the run's own
conversations, every turn, as the worker does.

The steady window opens when as many requests have finished as are kept in flight (the first
wave, which started together, is over) and closes when the number in flight first falls below
the concurrency with no request waiting for the free slot (one refilled within :data:`HANDOFF`
of a median request still counts as held): in a multi-turn run that comes well before the last
request is sent, as conversations end and leave no next turn to fill their slot; after it, the
batch drains, where a speculative engine always looks fast. Each request's output tokens count
in proportion to the share of its time inside the window; the row gives the window's mean in
flight and its rate in each of :data:`WINDOWS` equal parts (the repeated windows a verdict
compares). A window shorter than a median request (not every slot turned over in it) is not
steady: the row measures the whole span and says so, and no verdict follows it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import aiohttp

from common.choices import MtpMode
from common.engine.speculative import VERIFY_CT, accept_length
from common.errors import DflashError

HANDOFF = 0.05   # a slot refilled within this share of a median request counts as never empty
WINDOWS = 2      # equal parts of the steady window, each with its own rate


@dataclass(frozen=True)
class BenchRow:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    p50_s: float
    p99_s: float
    verify_steps: int = 0       # the engine's verify steps (0: no speculative decoding)
    verified_tokens: int = 0    # output tokens of the requests that had verify steps
    mtp: MtpMode | None = None  # bench --run: the configuration measured (off, on)
    p90_s: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)   # seconds since the first request was sent
    steady: bool = True         # False: too few requests for a steady window (the whole span)
    total_tokens: int = 0       # output tokens of every request (the window's are above)
    conversations: int = 0      # bench --run: conversations run (every turn each)
    window_requests: int = 0    # requests answered inside the window
    in_flight: float = 0.0      # requests in flight inside the window, on average over its time
    window_rates: tuple[float, ...] = ()   # output tokens/s in each of WINDOWS parts (steady)

    def __post_init__(self) -> None:
        if self.mtp is not None:   # a member however it came (a caller's text too)
            object.__setattr__(self, "mtp", MtpMode(self.mtp))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        """Requests answered inside the window, per second of it."""
        return (self.window_requests or self.requests) / self.seconds

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.verified_tokens, self.verify_steps)

    def to_json(self) -> dict[str, Any]:
        row = {"concurrency": self.concurrency, "requests": self.requests,
               "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
               "output_tokens_per_s": round(self.tokens_per_s, 1),
               "requests_per_s": round(self.requests_per_s, 2),
               "latency_p50_s": round(self.p50_s, 3), "latency_p90_s": round(self.p90_s, 3),
               "latency_p99_s": round(self.p99_s, 3), "accept_length": self.accept_length,
               "window_s": [round(w, 3) for w in self.window], "steady": self.steady,
               "total_output_tokens": self.total_tokens, "conversations": self.conversations,
               "in_flight_mean": round(self.in_flight, 2),
               "window_rates": [round(r, 1) for r in self.window_rates]}
        return row if self.mtp is None else {"mtp": self.mtp.value, **row}   # plain text


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Sent:
    """One request as the closed loop saw it: sent, answered, its output tokens and verify
    steps, and when it was ready and began to wait for a slot (None: not recorded)."""

    start: float
    end: float
    tokens: int
    verify_steps: int = 0
    ready: float | None = None


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               ready: float | None = None) -> tuple[Sent, dict[str, Any]]:
    """One ``/generate`` request (``ready``: since when it waited for its slot): what it took
    and what came back (DflashError for a non-200)."""
    started = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            raise DflashError(f"{url}/generate answered HTTP {response.status}: "
                              f"{(await response.text())[:200]}")
        data = await response.json(content_type=None)
    meta = data.get("meta_info", {})
    tokens = meta.get("completion_tokens", len(data.get("output_ids", [])))
    verify = meta.get(VERIFY_CT)
    return Sent(started, time.perf_counter(), int(tokens),
                verify if isinstance(verify, int) else 0, ready), data


def _share(sent: Sent, lo: float, hi: float) -> float:
    """The share of ``sent``'s time inside [lo, hi]."""
    span = sent.end - sent.start
    inside = max(0.0, min(sent.end, hi) - max(sent.start, lo))
    return inside / span if span > 0 else float(lo <= sent.end <= hi)


def falls_below(sent: list[Sent], level: int, opens: float, grace: float) -> float:
    """When the number in flight first falls below ``level`` at or after ``opens`` with no
    request waiting for the free slot, and is not back within ``grace`` seconds (a slot handed
    on); the last answer's time if never."""
    # (time, order at the same instant: ready, sent, answered; in flight, waiting)
    events = sorted([(s.ready, 0, 0, 1) for s in sent if s.ready is not None]
                    + [(s.start, 1, 1, -(s.ready is not None)) for s in sent]
                    + [(s.end, 2, -1, 0) for s in sent])
    count = waiting = 0
    below: float | None = None
    for at, _, step, queued in events:
        if below is not None and at - below > grace:
            return below
        count, waiting = count + step, waiting + queued
        if at < opens:
            continue
        if count < level and not waiting and below is None:
            below = at
        elif count >= level or waiting:
            below = None
    return below if below is not None else events[-1][0]


def _rate(sent: list[Sent], lo: float, hi: float) -> float:
    """Output tokens/s inside [lo, hi], each request's in proportion to its time there."""
    return sum(s.tokens * _share(s, lo, hi) for s in sent) / max(hi - lo, 1e-9)


def steady_row(sent: list[Sent], concurrency: int, mtp: MtpMode | None = None,
               conversations: int = 0) -> BenchRow:
    """The row of a closed loop's requests, its rate taken over the steady window."""
    if not sent:
        raise DflashError("no request was answered: nothing to measure")
    first = min(s.start for s in sent)
    ends = sorted(s.end for s in sent)
    latencies = [s.end - s.start for s in sent]
    median = statistics.median(latencies)
    # Steady only while all slots are held, and long enough for each to turn over once.
    opens = ends[concurrency - 1] if len(ends) > concurrency else ends[-1]
    closes = falls_below(sent, concurrency, opens, HANDOFF * median)
    steady = len(ends) > concurrency and closes - opens >= median
    lo, hi = (opens, closes) if steady else (first, ends[-1])
    shares = [_share(s, lo, hi) for s in sent]
    verified = [(s, w) for s, w in zip(sent, shares, strict=True) if s.verify_steps]
    span = max(hi - lo, 1e-9)
    parts = pairwise([lo + (hi - lo) * i / WINDOWS for i in range(WINDOWS + 1)])
    rates = tuple(_rate(sent, a, b) for a, b in parts) if steady else ()
    return BenchRow(concurrency, len(sent),
                    round(sum(s.tokens * w for s, w in zip(sent, shares, strict=True))),
                    span, median, percentile(latencies, 0.99),
                    verify_steps=round(sum(s.verify_steps * w for s, w in verified)),
                    verified_tokens=round(sum(s.tokens * w for s, w in verified)), mtp=mtp,
                    p90_s=percentile(latencies, 0.9), window=(lo - first, hi - first),
                    steady=steady, total_tokens=sum(s.tokens for s in sent),
                    conversations=conversations,
                    window_requests=sum(1 for s in sent if lo < s.end <= hi),
                    in_flight=sum(max(0.0, min(s.end, hi) - max(s.start, lo))
                                  for s in sent) / span,
                    window_rates=rates)


def synthetic_bodies(num: int, prompt_len: int, max_new_tokens: int,
                     seed: int) -> list[dict[str, Any]]:
    """``num`` distinct random prompts of ``prompt_len`` tokens."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(100, 1000) for _ in range(prompt_len)],
             "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.6}}
            for _ in range(num)]


async def measure(url: str, concurrency: int, bodies: list[dict[str, Any]],
                  mtp: MtpMode | None = None) -> BenchRow:
    """Every body sent with ``concurrency`` in flight; the row of what came back."""
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def bounded(body: dict[str, Any]) -> Sent:
            ready = time.perf_counter()
            async with slots:
                return (await post(s, url, body, ready))[0]

        sent = await asyncio.gather(*(bounded(b) for b in bodies))
    return steady_row(list(sent), concurrency, mtp)


async def run_level(url: str, concurrency: int, num: int, prompt_len: int,
                    max_new_tokens: int, seed: int) -> BenchRow:
    """``num`` requests with ``concurrency`` in flight, each a distinct random prompt."""
    return await measure(url, concurrency,
                         synthetic_bodies(num, prompt_len, max_new_tokens, seed))


def run_bench(url: str, levels: list[int], num: int, prompt_len: int,
              max_new_tokens: int) -> list[BenchRow]:
    try:
        return [asyncio.run(run_level(url.rstrip("/"), c, num, prompt_len, max_new_tokens, i))
                for i, c in enumerate(levels)]
    except aiohttp.ClientError as exc:
        raise DflashError(f"cannot benchmark {url}: {exc}") from exc


def render_table(rows: list[BenchRow]) -> str:
    best = max(rows, key=lambda r: r.tokens_per_s)
    mtp = any(r.mtp is not None for r in rows)
    lines = [("mtp " if mtp else "") + f"{'concurrency':>11} {'out tok/s':>10} {'req/s':>8} "
             f"{'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'accept':>7}  window s"]
    lines += [(f"{r.mtp or '-':<4}" if mtp else "")
              + f"{r.concurrency:>11} {r.tokens_per_s:>10.1f} {r.requests_per_s:>8.2f} "
              f"{r.p50_s:>8.3f} {r.p90_s:>8.3f} {r.p99_s:>8.3f} "
              f"{r.accept_length if r.accept_length is not None else '-':>7}  "
              f"{r.window[0]:.1f}-{r.window[1]:.1f}" + ("" if r.steady else " (whole span)")
              for r in rows]
    lines.append("rates over the steady window: from the first wave's end until fewer than the "
                 "concurrency are in flight (warm-up and drain left out)")
    if not all(r.steady for r in rows):
        lines.append("whole span: no steady window at that concurrency (too few requests, or "
                     "conversations ending before its slots turned over); raise --num, no "
                     "verdict follows it")
    lines.append(f"best: concurrency {best.concurrency} ({best.tokens_per_s:.1f} output tok/s"
                 + (f", mtp {best.mtp}" if best.mtp else "") + "); use --max-in-flight "
                 f"{best.concurrency} on the generate workers")
    return "\n".join(lines)
