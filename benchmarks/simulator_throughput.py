"""The simulator's batching model in tokens per second: throughput grows with concurrency up to
the batch cap, then flattens.

Run: ``.venv/bin/python benchmarks/simulator_throughput.py [--cap 64] [--window 2]``.
Starts ``python -m embedded.simulator --max-running CAP --time-scale 0.25 --len-mu 7`` and, for
each concurrency (4, CAP/2, CAP, 4*CAP), keeps that many clients each with one request open
and counts the server's generated tokens over the window (from ``/sim/stats``, so the clients'
own speed does not enter). Prints tok/s per concurrency and the two ratios the model promises:
``CAP/2 vs 4`` (about CAP/8: more requests per step) and ``4*CAP vs CAP`` (about 1: the cap
holds the rest in the queue). A timing check, so here and not in tests/ (a busy machine skews
it); tests/test_simulator.py checks the same property on the server's in-flight counters.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer.demo import free_port  # noqa: E402

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


async def throughput(url: str, concurrency: int, window: float) -> float:
    """Server-side output tokens per second while ``concurrency`` clients keep a request open."""
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def stats() -> dict:
            async with session.get(url + "/sim/stats") as resp:
                return await resp.json()

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                body = {"input_ids": [i, n, *PROMPT], "sampling_params": {"max_new_tokens": 128}}
                async with session.post(url + "/generate", json=body) as resp:
                    await resp.read()
                n += 1

        tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
        while (s := await stats())["running"] + s["queued"] < concurrency:  # ramp up
            await asyncio.sleep(0.02)
        before, t0 = await stats(), time.monotonic()
        await asyncio.sleep(window)
        after, t1 = await stats(), time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
    return (after["generated_tokens"] - before["generated_tokens"]) / (t1 - t0)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=64, help="the simulator's --max-running")
    parser.add_argument("--window", type=float, default=2.0, help="seconds measured per level")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedded.simulator", "--port", str(port), "--max-running",
         str(args.cap), "--time-scale", "0.25", "--len-mu", "7"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not healthy(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit("the simulator did not come up")
            time.sleep(0.1)
        levels = (4, args.cap // 2, args.cap, 4 * args.cap)
        rates = {c: asyncio.run(throughput(url, c, args.window)) for c in levels}
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    for c, rate in rates.items():
        print(f"concurrency {c:4d}: {rate:9,.0f} output tok/s")
    half, cap = args.cap // 2, args.cap
    print(f"{half} vs 4: {rates[half] / rates[4]:.2f}x (the model: about {half / 4:.0f}x)")
    print(f"{4 * cap} vs {cap}: {rates[4 * cap] / rates[cap]:.2f}x (the model: about 1x)")


if __name__ == "__main__":
    main()
