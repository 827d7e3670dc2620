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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import load_settings  # noqa: E402
from common.models import resolve_model_path  # noqa: E402
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
                 max_new: int) -> tuple[float, int, float]:
    """The reference: a bare asyncio client keeping ``cap`` requests in flight.

    It does what any client of the engine must do per sample (apply the chat template,
    tokenize, one ``/generate`` call, decode the output) and nothing else; returns wall seconds,
    output tokens and the CPU seconds this process spent.
    """
    slots = asyncio.Semaphore(cap)
    backend = tokenizer.backend_tokenizer
    params = {"max_new_tokens": max_new, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "skip_special_tokens": False}
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
    """Polls the simulator's running count to measure occupancy."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            stats = get_json(f"{self.url}/sim/stats")
            self.samples.append((time.perf_counter(), stats["running"], stats["requests"]))


def pin(cpus: set[int]) -> Callable[[], None] | None:
    """A preexec_fn keeping a child on ``cpus``: the simulator's busy loop gets its own core,
    so the clients' CPU time is not inflated by whatever shares theirs (less noise)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
ENGINE_CPUS = set(ALL_CPUS[:1]) if len(ALL_CPUS) >= 2 else set()
CLIENT_CPUS = set(ALL_CPUS[1:]) if len(ALL_CPUS) >= 2 else set()


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
    parser.add_argument("--direct", metavar="URL", help="internal: run only the direct client")
    args = parser.parse_args()
    model = resolve_model_path(load_settings())
    questions = [json.loads(line)["turns"][0]
                 for line in (ROOT / "data" / "mt_bench_question.jsonl").read_text().splitlines()]
    rows = [{"id": f"b{i}", "prompt": f"{questions[i % len(questions)]} (variant {i})"}
            for i in range(args.rows)]
    if args.direct:
        from transformers import AutoTokenizer

        seconds, tokens, cpu = asyncio.run(direct(
            args.direct, AutoTokenizer.from_pretrained(model), rows, args.cap,
            args.max_new_tokens))
        print(json.dumps({"seconds": seconds, "tokens": tokens, "cpu": cpu}))
        return

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        sim = subprocess.Popen([sys.executable, "-m", "embedded.simulator", "--port",
                                str(port), "--max-running", str(args.cap), "--model-path",
                                str(model), "--len-mu", "5.0", "--len-sigma", "0.8"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=pin(ENGINE_CPUS))
        url = f"http://127.0.0.1:{port}"
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
            wait(lambda: get_json(f"{url}/sim/stats") is not None, 60, "the simulator")
            wait(lambda: " ready." in (work / "worker.log").read_text(), 120, "the worker")
            rounds = []
            for number in range(args.rounds):
                rounds.append(one_round(args, url, work, env, worker.pid, f"bench-{number}"))
                print_round(f"round {number + 1}", rounds[-1])
        finally:
            for proc in (worker, sim, redis_proc):
                proc.terminate()
                proc.wait(timeout=30)
    report(rounds)


def one_round(args: argparse.Namespace, url: str, work: Path, env: dict[str, str], pid: int,
              run: str) -> Round:
    """Direct client, then the pipeline on a new run of the same rows."""
    direct_sampler = Sampler(url)
    direct_sampler.start()
    # Its own process, so that the sampler's polling is not counted as client CPU.
    measured = json.loads(subprocess.run(
        [sys.executable, __file__, "--direct", url, "--rows", str(args.rows), "--cap",
         str(args.cap), "--max-new-tokens", str(args.max_new_tokens)],
        check=True, capture_output=True, text=True, preexec_fn=pin(CLIENT_CPUS)).stdout)
    direct_sampler.stop.set()
    cpu_before = sum(psutil.Process(pid).cpu_times()[:2])
    sent_before = get_json(f"{url}/sim/stats")["requests"]
    sampler = Sampler(url)
    started = time.perf_counter()
    sampler.start()
    enqueue_cpu = children_cpu()
    subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--input",
                    str(work / "in.jsonl"), "--run", run, "--shard-size",
                    str(args.rows // args.shards), "--max-new-tokens",
                    str(args.max_new_tokens)], env=env, cwd=ROOT, check=True,
                   capture_output=True)
    enqueue_cpu = children_cpu() - enqueue_cpu
    commits = work / "storage" / "runs" / run / "generated"
    wait(lambda: len(list(commits.glob("*/_COMMIT.json"))) == args.shards, 3600,
         "the pipeline run")
    finished = time.perf_counter()
    sampler.stop.set()
    cpu = sum(psutil.Process(pid).cpu_times()[:2]) - cpu_before
    tokens = sum(json.loads(c.read_text())["stats"]["completion_tokens"]
                 for c in commits.glob("*/_COMMIT.json"))
    first = next(t for t, _, sent in sampler.samples if sent > sent_before)
    # While requests remain to be sent, every free slot could be filled: the engine's own tail
    # (the last requests finishing) is the same for any client and is reported separately.
    backlog = [running for _, running, sent in sampler.samples
               if running > 0 and sent - sent_before < args.rows]
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


def report(rounds: list[Round]) -> None:
    """Print the three figures as medians over the rounds."""
    def med(name: str) -> float:
        return statistics.median(getattr(r, name) for r in rounds)

    print(f"medians over {len(rounds)} rounds:")
    print(f"(a) throughput ratio pipeline/direct: "
          f"{statistics.median(r.rate / r.direct_rate for r in rounds):.3f} from the pipeline's "
          f"first request to its last commit (target >= 0.98); "
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
