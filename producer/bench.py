"""``dflash-pipeline bench``: throughput of an SGLang-protocol server at several concurrencies.

The seed's "benchmark throughput on 1 GPU" before a long run: for each concurrency, keep that many
``/generate`` requests in flight until ``--num`` have finished, then report output tokens/s,
requests/s and latency percentiles, the engine's accept length where it decodes speculatively
(SGLang's ``spec_verify_ct``: output tokens / verify steps), and the best setting. Synthetic
prompts here; ``bench --run`` (:mod:`producer.bench_run`) draws the run's own.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.engine.speculative import VERIFY_CT, accept_length
from common.errors import DflashError


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
    mtp: str | None = None      # bench --run: the configuration measured (off, on)
    p90_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.verified_tokens, self.verify_steps)

    def to_json(self) -> dict[str, Any]:
        row = {"concurrency": self.concurrency, "requests": self.requests,
               "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
               "output_tokens_per_s": round(self.tokens_per_s, 1),
               "requests_per_s": round(self.requests_per_s, 2),
               "latency_p50_s": round(self.p50_s, 3), "latency_p90_s": round(self.p90_s, 3),
               "latency_p99_s": round(self.p99_s, 3), "accept_length": self.accept_length}
        return row if self.mtp is None else {"mtp": self.mtp, **row}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, url: str,
               body: dict[str, Any]) -> tuple[int, float, int]:
    """(output tokens, latency, verify steps) of one request."""
    started = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            raise DflashError(f"{url}/generate answered HTTP {response.status}: "
                              f"{(await response.text())[:200]}")
        data = await response.json(content_type=None)
    meta = data.get("meta_info", {})
    tokens = meta.get("completion_tokens", len(data.get("output_ids", [])))
    verify = meta.get(VERIFY_CT)
    return int(tokens), time.perf_counter() - started, verify if isinstance(verify, int) else 0


def synthetic_bodies(num: int, prompt_len: int, max_new_tokens: int,
                     seed: int) -> list[dict[str, Any]]:
    """``num`` distinct random prompts of ``prompt_len`` tokens."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(100, 1000) for _ in range(prompt_len)],
             "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.6}}
            for _ in range(num)]


async def measure(url: str, concurrency: int, bodies: list[dict[str, Any]],
                  mtp: str | None = None) -> BenchRow:
    """Every body sent with ``concurrency`` in flight; the row of what came back."""
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def bounded(body: dict[str, Any]) -> tuple[int, float, int]:
            async with slots:
                return await _one(s, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        seconds = time.perf_counter() - started
    latencies = [lat for _, lat, _ in results]
    return BenchRow(concurrency, len(bodies), sum(t for t, _, _ in results), seconds,
                    statistics.median(latencies), percentile(latencies, 0.99),
                    verify_steps=sum(v for _, _, v in results),
                    verified_tokens=sum(t for t, _, v in results if v), mtp=mtp,
                    p90_s=percentile(latencies, 0.9))


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
             f"{'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'accept':>7}"]
    lines += [(f"{r.mtp or '-':<4}" if mtp else "")
              + f"{r.concurrency:>11} {r.tokens_per_s:>10.1f} {r.requests_per_s:>8.2f} "
              f"{r.p50_s:>8.3f} {r.p90_s:>8.3f} {r.p99_s:>8.3f} "
              f"{r.accept_length if r.accept_length is not None else '-':>7}" for r in rows]
    lines.append(f"best: concurrency {best.concurrency} ({best.tokens_per_s:.1f} output tok/s"
                 + (f", mtp {best.mtp}" if best.mtp else "") + "); use --max-in-flight "
                 f"{best.concurrency} on the generate workers")
    return "\n".join(lines)
