"""Pipeline vs a direct asyncio driver of the same engine simulator, side by side in one run.

Run: ``.venv/bin/python benchmarks/pipeline_vs_direct.py [--rows 512] [--shards 4] [--cap 64]``.
Prints (a) throughput ratio pipeline / direct (target >= 0.98), (b) engine occupancy = mean
running requests / batch cap while the pipeline runs its shards back to back (target >= 0.97),
(c) orchestration CPU of the worker process per sample (target <= 200 us). Both sides send the
same prompts (the chat template applied by the tokenizer) to one simulator with long-tailed
output lengths; the simulator's lengths are a function of the prompt, so both generate the same
tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

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


async def direct(url: str, prompts: list[list[int]], cap: int, max_new: int) -> tuple[float, int]:
    """The reference: a bare asyncio client keeping ``cap`` requests in flight."""
    slots = asyncio.Semaphore(cap)
    params = {"max_new_tokens": max_new, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cap)) as session:
        async def one(ids: list[int]) -> int:
            async with slots, session.post(f"{url}/generate", json={
                    "input_ids": ids, "sampling_params": params}) as response:
                return len((await response.json())["output_ids"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - started, sum(tokens)


class Sampler(threading.Thread):
    """Polls the simulator's running count to measure occupancy."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            stats = get_json(f"{self.url}/sim/stats")
            self.samples.append((stats["running"], stats["requests"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    args = parser.parse_args()
    model = resolve_model_path(load_settings())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = [json.loads(line)["turns"][0]
                 for line in (ROOT / "data" / "mt_bench_question.jsonl").read_text().splitlines()]
    rows = [{"id": f"b{i}", "prompt": f"{questions[i % len(questions)]} (variant {i})"}
            for i in range(args.rows)]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True,
        enable_thinking=True), add_special_tokens=False) for r in rows]

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        sim = subprocess.Popen([sys.executable, "-m", "workers.engines.simulator", "--port",
                                str(port), "--max-running", str(args.cap), "--model-path",
                                str(model), "--len-mu", "5.0", "--len-sigma", "0.8"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        redis_port = free_port()
        redis_proc = start_redis(work / "redis", redis_port)
        env = dict(os.environ, DFLASH_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
                   DFLASH_STORAGE=str(work / "storage"), DFLASH_PART_SAMPLES="64")
        worker = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate", "--engine", "sglang",
             "--engine-url", url, "--max-in-flight", str(args.cap), "--concurrency", "2",
             "--loglevel", "INFO"], env=env, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=open(work / "worker.log", "w"))  # noqa: SIM115
        try:
            wait(lambda: get_json(f"{url}/sim/stats") is not None, 60, "the simulator")
            seconds_direct, tokens_direct = asyncio.run(
                direct(url, prompts, args.cap, args.max_new_tokens))
            (work / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            wait(lambda: " ready." in (work / "worker.log").read_text(), 120, "the worker")
            cpu_before = sum(psutil.Process(worker.pid).cpu_times()[:2])
            sent_before = get_json(f"{url}/sim/stats")["requests"]
            sampler = Sampler(url)
            started = time.perf_counter()
            sampler.start()
            subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--input",
                            str(work / "in.jsonl"), "--run", "bench", "--shard-size",
                            str(args.rows // args.shards), "--max-new-tokens",
                            str(args.max_new_tokens)], env=env, cwd=ROOT, check=True,
                           capture_output=True)
            commits = work / "storage" / "runs" / "bench" / "generated"
            wait(lambda: len(list(commits.glob("*/_COMMIT.json"))) == args.shards, 3600,
                 "the pipeline run")
            seconds_pipe = time.perf_counter() - started
            sampler.stop.set()
            cpu = sum(psutil.Process(worker.pid).cpu_times()[:2]) - cpu_before
            tokens_pipe = sum(json.loads(c.read_text())["stats"]["completion_tokens"]
                              for c in commits.glob("*/_COMMIT.json"))
        finally:
            for proc in (worker, sim, redis_proc):
                proc.terminate()
                proc.wait(timeout=30)
    busy = [running for running, _ in sampler.samples if running > 0]
    # While requests remain to be sent, every free slot could be filled: the engine's own tail
    # (the last requests finishing) is the same for any client and is reported separately.
    backlog = [running for running, sent in sampler.samples
               if running > 0 and sent - sent_before < args.rows]
    print(f"direct:   {tokens_direct} tokens in {seconds_direct:.2f}s "
          f"= {tokens_direct / seconds_direct:,.0f} tok/s")
    print(f"pipeline: {tokens_pipe} tokens in {seconds_pipe:.2f}s "
          f"= {tokens_pipe / seconds_pipe:,.0f} tok/s (includes enqueue, parts, commits)")
    print(f"(a) throughput ratio pipeline/direct: "
          f"{(tokens_pipe / seconds_pipe) / (tokens_direct / seconds_direct):.3f} (target >= 0.98)")
    print(f"(b) occupancy mean running/cap while busy: "
          f"{sum(busy) / len(busy) / args.cap:.3f} over {len(busy)} samples; while requests "
          f"remained to send: {sum(backlog) / max(len(backlog), 1) / args.cap:.3f} "
          "(target >= 0.97)")
    print(f"(c) orchestration CPU per sample: {cpu / args.rows * 1e6:,.0f} us "
          f"({cpu:.2f}s worker CPU for {args.rows} samples; target <= 200 us)")


if __name__ == "__main__":
    main()
