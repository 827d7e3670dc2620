"""Pipeline vs a direct asyncio driver of the same engine simulator, side by side in one run.

Run: ``.venv/bin/python benchmarks/pipeline_vs_direct.py [--rows 2048] [--shards 8] [--cap 64]
[--rounds 3]``. Each round runs the direct client, then the pipeline (enqueue + one generate
worker with its default settings: no ``--concurrency``) on the same rows; the figures are
medians over the rounds:

(a) throughput ratio pipeline / direct (target >= 0.98), the pipeline timed from its first
    request to its last commit (the enqueue command's start-up is printed beside it);
(b) engine occupancy = mean running requests / batch cap while the pipeline runs its shards back
    to back and requests remain to be sent (target >= 0.97); the final drain, which no client
    can fill, is shown with and without, beside the direct client's;
(c) orchestration CPU per sample (target <= 200 us): the worker process's CPU per sample minus
    the direct client's, which does only what any client must (apply the chat template,
    tokenize, one ``/generate`` call, decode the output). The rest is the pipeline's own:
    Celery, leases, gates, parts, commits, progress.

Both sides send the same prompts to one simulator with long-tailed output lengths; its lengths
are a function of the prompt, so both generate the same tokens.

``--engine sglang`` drives the real SGLang instead (the pinned release from ``.venv-sglang``,
``bash scripts/setup.sh --sglang``) on the CPU with the tiny dense target, launched by the
product's own launcher as ``worker generate --engine sglang --engine-python`` would; greedy
decoding (``--temperature 0``) makes both sides generate the same tokens. Its figures are the
throughput ratio (target >= 0.95 on this CPU) and the occupancy read from the server's own
``/metrics`` (``sglang:num_running_reqs``), e.g.
``benchmarks/pipeline_vs_direct.py --engine sglang --rows 96 --shards 4 --cap 16
--max-new-tokens 64 --rounds 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engines import (  # noqa: E402
    CLIENT_CPUS,
    pin,
    sglang_gauges,
    start_engine,
    stop_engine,
)
from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from producer.demo import free_port, start_redis  # noqa: E402


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"timed out waiting for {what}")


async def direct(url: str, tokenizer: Any, rows: list[dict[str, Any]], cap: int,
                 max_new: int, temperature: float) -> tuple[float, int, float]:
    """The reference: a bare asyncio client keeping ``cap`` requests in flight.

    It does what any client of the engine must do per sample (apply the chat template,
    tokenize, one ``/generate`` call, decode the output) and nothing else; returns wall seconds,
    output tokens and the CPU seconds this process spent.
    """
    slots = asyncio.Semaphore(cap)
    backend = tokenizer.backend_tokenizer
    params = {"max_new_tokens": max_new, "temperature": temperature, "top_p": 0.95,
              "top_k": 20, "skip_special_tokens": False}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cap)) as session:
        async def one(row: dict[str, Any]) -> int:
            async with slots:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": row["prompt"]}], tokenize=False,
                    add_generation_prompt=True, enable_thinking=True)
                ids = backend.encode(text, add_special_tokens=False).ids
                async with session.post(f"{url}/generate", json={
                        "input_ids": ids, "sampling_params": params}) as response:
                    output_ids = (await response.json())["output_ids"]
                backend.decode(output_ids, skip_special_tokens=False)
                return len(output_ids)

        cpu, started = time.process_time(), time.perf_counter()
        tokens = await asyncio.gather(*(one(r) for r in rows))
    return time.perf_counter() - started, sum(tokens), time.process_time() - cpu


class Sampler(threading.Thread):
    """Polls the engine's running count to measure occupancy (the simulator's counters, or a
    real server's /metrics)."""

    def __init__(self, url: str, real: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop, self.real = url, [], threading.Event(), real

    def read(self) -> tuple[int, int]:
        if self.real:
            return sglang_gauges(self.url)
        stats = get_json(f"{self.url}/sim/stats")
        return stats["running"], stats["requests"]

    def run(self) -> None:
        while not self.stop.wait(0.02 if not self.real else 0.1):
            self.samples.append((time.perf_counter(), *self.read()))


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Round:
    """One direct run and one pipeline run of the same rows, back to back."""

    direct_rate: float
    direct_cpu: float  # seconds per sample
    direct_occupancy: float
    rate: float  # from the pipeline's first request to its last commit
    rate_e2e: float  # from the enqueue command's start
    startup: float
    occupancy_backlog: float
    occupancy: float
    worker_cpu: float
    enqueue_cpu: float

    @property
    def overhead(self) -> float:
        return self.worker_cpu - self.direct_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="direct + pipeline pairs; medians")
    parser.add_argument("--temperature", type=float, default=None,
                        help="both sides [default: 0.6 on the simulator, 0 on SGLang]")
    parser.add_argument("--engine", choices=["sim", "sglang"], default="sim",
                        help="the simulator, or the real SGLang on the CPU (.venv-sglang)")
    parser.add_argument("--direct", metavar="URL", help="internal: run only the direct client")
    args = parser.parse_args()
    if args.temperature is None:
        args.temperature = 0.0 if args.engine == "sglang" else 0.6
    model = resolve_model_path(load_settings())
    questions = [json.loads(line)["turns"][0]
                 for line in (ROOT / "data" / "mt_bench_question.jsonl").read_text().splitlines()]
    rows = [{"id": f"b{i}", "prompt": f"{questions[i % len(questions)]} (variant {i})"}
            for i in range(args.rows)]
    if args.direct:
        from transformers import AutoTokenizer

        seconds, tokens, cpu = asyncio.run(direct(
            args.direct, AutoTokenizer.from_pretrained(model), rows, args.cap,
            args.max_new_tokens, args.temperature))
        print(json.dumps({"seconds": seconds, "tokens": tokens, "cpu": cpu}))
        return

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        sim = start_engine(args, model, port, work)
        redis_port = free_port()
        redis_proc = start_redis(work / "redis", redis_port)
        env = dict(os.environ, DFLASH_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
                   DFLASH_STORAGE=str(work / "storage"), DFLASH_PART_SAMPLES="64")
        worker = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate", "--engine", "sglang",
             "--engine-url", url, "--max-in-flight", str(args.cap), "--loglevel", "INFO"],
            env=env, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=open(work / "worker.log", "w"),  # noqa: SIM115
            preexec_fn=pin(CLIENT_CPUS))
        (work / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        try:
            wait(lambda: Sampler(url, args.engine == "sglang").read() is not None, 900,
                 "the engine")
            wait(lambda: " ready." in (work / "worker.log").read_text(), 120, "the worker")
            rounds = []
            for number in range(args.rounds):
                rounds.append(one_round(args, url, work, env, worker.pid, f"bench-{number}"))
                print_round(f"round {number + 1}", rounds[-1])
        finally:
            for proc in (worker, redis_proc):
                proc.terminate()
                proc.wait(timeout=30)
            stop_engine(sim)
    report(rounds, 0.95 if args.engine == "sglang" else 0.98)


def one_round(args: argparse.Namespace, url: str, work: Path, env: dict[str, str], pid: int,
              run: str) -> Round:
    """Direct client, then the pipeline on a new run of the same rows."""
    real = args.engine == "sglang"
    direct_sampler = Sampler(url, real)
    direct_sampler.start()
    # Its own process, so that the sampler's polling is not counted as client CPU.
    measured = json.loads(subprocess.run(
        [sys.executable, __file__, "--direct", url, "--rows", str(args.rows), "--cap",
         str(args.cap), "--max-new-tokens", str(args.max_new_tokens), "--engine", args.engine,
         "--temperature", str(args.temperature)],
        check=True, capture_output=True, text=True, preexec_fn=pin(CLIENT_CPUS)).stdout)
    direct_sampler.stop.set()
    cpu_before = sum(psutil.Process(pid).cpu_times()[:2])
    sent_before = Sampler(url, real).read()[1]
    sampler = Sampler(url, real)
    started = time.perf_counter()
    sampler.start()
    enqueue_cpu = children_cpu()
    subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--input",
                    str(work / "in.jsonl"), "--run", run, "--shard-size",
                    str(args.rows // args.shards), "--max-new-tokens",
                    str(args.max_new_tokens), "--temperature", str(args.temperature),
                    # a throughput run: greedy replies repeat, and a pause would stall it
                    "--max-reject-rate", "1"],
                   env=env, cwd=ROOT, check=True,
                   capture_output=True)
    enqueue_cpu = children_cpu() - enqueue_cpu
    queued = time.perf_counter()
    commits = work / "storage" / "runs" / run / "generated"
    wait(lambda: len(list(commits.glob("*/_COMMIT.json"))) == args.shards, 3600,
         "the pipeline run")
    finished = time.perf_counter()
    sampler.stop.set()
    cpu = sum(psutil.Process(pid).cpu_times()[:2]) - cpu_before
    tokens = sum(json.loads(c.read_text())["stats"]["completion_tokens"]
                 for c in commits.glob("*/_COMMIT.json"))
    # A real server's counters move only as requests finish: its pipeline is timed from the
    # moment enqueue returned, its shards queued (an upper bound on the first request's time).
    first = queued if real else next(t for t, _, sent in sampler.samples if sent > sent_before)
    # While requests remain to be sent, every free slot could be filled: the engine's own tail
    # (the last requests finishing) is the same for any client and is reported separately.
    # (A real server counts prompt tokens, not requests: its whole busy time is shown.)
    backlog = [running for _, running, sent in sampler.samples
               if running > 0 and (real or sent - sent_before < args.rows)]
    return Round(
        direct_rate=measured["tokens"] / measured["seconds"],
        direct_cpu=measured["cpu"] / args.rows,
        direct_occupancy=busy_mean(direct_sampler.samples) / args.cap,
        rate=tokens / (finished - first), rate_e2e=tokens / (finished - started),
        startup=first - started,
        occupancy_backlog=sum(backlog) / max(len(backlog), 1) / args.cap,
        occupancy=busy_mean(sampler.samples) / args.cap,
        worker_cpu=cpu / args.rows, enqueue_cpu=enqueue_cpu / args.rows)


def busy_mean(samples: list[tuple[float, int, int]]) -> float:
    busy = [running for _, running, _ in samples if running > 0]
    return sum(busy) / max(len(busy), 1)


def print_round(title: str, r: Round) -> None:
    print(f"{title}: direct {r.direct_rate:,.0f} tok/s, {r.direct_cpu * 1e6:,.0f} us CPU/sample, "
          f"occupancy {r.direct_occupancy:.3f} | pipeline {r.rate:,.0f} tok/s "
          f"({r.rate_e2e:,.0f} with enqueue's {r.startup:.2f}s), worker "
          f"{r.worker_cpu * 1e6:,.0f} us CPU/sample, occupancy {r.occupancy_backlog:.3f} "
          f"({r.occupancy:.3f} with the drain)", flush=True)


def report(rounds: list[Round], target: float = 0.98) -> None:
    """Print the three figures as medians over the rounds."""
    def med(name: str) -> float:
        return statistics.median(getattr(r, name) for r in rounds)

    print(f"medians over {len(rounds)} rounds:")
    print(f"(a) throughput ratio pipeline/direct: "
          f"{statistics.median(r.rate / r.direct_rate for r in rounds):.3f} from the pipeline's "
          f"first request to its last commit (target >= {target}); "
          f"{statistics.median(r.rate_e2e / r.direct_rate for r in rounds):.3f} counting the "
          f"enqueue command's start-up ({med('startup'):.2f}s)")
    print(f"(b) occupancy mean running/cap while requests remained to send: "
          f"{med('occupancy_backlog'):.3f} (target >= 0.97); {med('occupancy'):.3f} including "
          f"the engine's final drain, where the direct client gets {med('direct_occupancy'):.3f}")
    print(f"(c) orchestration CPU per sample: {med('overhead') * 1e6:,.0f} us (target <= 200 us)"
          f" = worker {med('worker_cpu') * 1e6:,.0f} us - direct client "
          f"{med('direct_cpu') * 1e6:,.0f} us (chat template, tokenize, /generate, decode); "
          f"the enqueue command: {med('enqueue_cpu') * 1e6:,.0f} us per sample, interpreter "
          "start included")


if __name__ == "__main__":
    main()
