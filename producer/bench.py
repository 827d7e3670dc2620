"""``dflash-pipeline bench``: throughput of an SGLang-protocol server at several concurrencies.

The seed's "benchmark throughput on 1 GPU" before a long run: for each concurrency, keep that many
``/generate`` requests in flight until ``--num`` have finished, then report output tokens/s,
requests/s and latency percentiles, and the best setting.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.errors import DflashError


@dataclass(frozen=True)
class BenchRow:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    p50_s: float
    p99_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": self.requests,
                "output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
                "output_tokens_per_s": round(self.tokens_per_s, 1),
                "requests_per_s": round(self.requests_per_s, 2),
                "latency_p50_s": round(self.p50_s, 3), "latency_p99_s": round(self.p99_s, 3)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, float]:
    started = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            raise DflashError(f"{url}/generate answered HTTP {response.status}: "
                              f"{(await response.text())[:200]}")
        data = await response.json(content_type=None)
    meta = data.get("meta_info", {})
    tokens = meta.get("completion_tokens", len(data.get("output_ids", [])))
    return int(tokens), time.perf_counter() - started


async def run_level(url: str, concurrency: int, num: int, prompt_len: int,
                    max_new_tokens: int, seed: int) -> BenchRow:
    """``num`` requests with ``concurrency`` in flight, each a distinct random prompt."""
    rng = random.Random(seed)
    bodies = [{"input_ids": [rng.randrange(100, 1000) for _ in range(prompt_len)],
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.6}}
              for _ in range(num)]
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def bounded(body: dict[str, Any]) -> tuple[int, float]:
            async with slots:
                return await _one(s, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        seconds = time.perf_counter() - started
    latencies = [lat for _, lat in results]
    return BenchRow(concurrency, num, sum(t for t, _ in results), seconds,
                    statistics.median(latencies), percentile(latencies, 0.99))


def run_bench(url: str, levels: list[int], num: int, prompt_len: int,
              max_new_tokens: int) -> list[BenchRow]:
    try:
        return [asyncio.run(run_level(url.rstrip("/"), c, num, prompt_len, max_new_tokens, i))
                for i, c in enumerate(levels)]
    except aiohttp.ClientError as exc:
        raise DflashError(f"cannot benchmark {url}: {exc}") from exc


def render_table(rows: list[BenchRow]) -> str:
    best = max(rows, key=lambda r: r.tokens_per_s)
    lines = [f"{'concurrency':>11} {'out tok/s':>10} {'req/s':>8} {'p50 s':>8} {'p99 s':>8}"]
    lines += [f"{r.concurrency:>11} {r.tokens_per_s:>10.1f} {r.requests_per_s:>8.2f} "
              f"{r.p50_s:>8.3f} {r.p99_s:>8.3f}" for r in rows]
    lines.append(f"best: concurrency {best.concurrency} ({best.tokens_per_s:.1f} output tok/s);"
                 f" use --max-in-flight {best.concurrency} on the generate workers")
    return "\n".join(lines)
