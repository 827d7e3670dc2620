"""Export throughput and memory: ``export-dataset`` over a synthetic run of 1,000,000 samples.

Run: ``.venv/bin/python benchmarks/export_dataset.py [--samples 1000000] [--shard-size 10000]
[--formats parquet,messages]``. Writes a synthetic run through the generate stage's own part
and commit code (two-turn samples, 64 prompt + 64 generated tokens a turn) into a local storage
root, then runs the real CLI on it in a child process per format and reads the child's peak RSS
from the kernel. Prints samples/s, MB/s of output and peak RSS; the target is < 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys  # noqa: E402
from common.runs.records import RunConfig, ShardTask, dumps  # noqa: E402
from common.storage import LocalStorage  # noqa: E402
from workers.generate.parts import ShardParts  # noqa: E402


def sample(i: int) -> dict:
    turns = [{"prompt_ids": list(range(i % 50, i % 50 + 64)),
              "output_ids": list(range(100 + t, 164 + t)), "finish_reason": "stop",
              "prompt_tokens": 64, "completion_tokens": 64} for t in range(2)]
    return {"id": f"s{i}", "shard": 0, "source": {"id": i},
            "messages": [{"role": "user", "content": f"Question {i}?"},
                         {"role": "assistant", "content": f"Answer {i}.",
                          "reasoning_content": f"Thinking about {i}."},
                         {"role": "user", "content": "Why?"},
                         {"role": "assistant", "content": "Because.",
                          "reasoning_content": "Reasons."}],
            "turns": turns, "prompt_ids": turns[-1]["prompt_ids"],
            "output_ids": turns[-1]["output_ids"], "finish_reason": "stop",
            "usage": {"prompt_tokens": 128, "completion_tokens": 128},
            "quality": {"passed": True, "reasons": []}}


def synthetic_run(root: Path, samples: int, shard_size: int) -> None:
    storage = LocalStorage(root)
    config = RunConfig(run="bench", model="tiny-qwen3", input="synthetic", format="auto",
                       prompt_field=None, shard_size=shard_size, limit=None)
    storage.put_once(keys.run_config("bench"), dumps(config.to_json()))
    for shard, first in enumerate(range(0, samples, shard_size)):
        batch = [sample(i) for i in range(first, min(first + shard_size, samples))]
        parts = ShardParts(storage, ShardTask("bench", shard))
        for start in range(0, len(batch), 1000):
            parts.write(batch[start:start + 1000])
        parts.commit([s["id"] for s in batch], "bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--formats", default="parquet,messages")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        synthetic_run(work / "storage", args.samples, args.shard_size)
        print(f"synthetic run: {args.samples} samples in {-(-args.samples // args.shard_size)} "
              f"shards, written in {time.perf_counter() - started:.1f}s")
        env = dict(os.environ, DFLASH_STORAGE=str(work / "storage"))
        for fmt in args.formats.split(","):
            out = work / f"out-{fmt}"
            started = time.perf_counter()
            with open(work / "stdout", "w") as stdout, open(work / "stderr", "w") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "export-dataset", "--run", "bench",
                     "--out", str(out), "--format", fmt, "--json"],
                    env=env, cwd=ROOT, stdout=stdout, stderr=stderr)
                _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"export failed: {(work / 'stderr').read_text()[-2000:]}")
            report = json.loads((work / "stdout").read_text())
            samples = sum(report["samples"].values())
            mib = report["bytes"] / 2**20
            peak = usage.ru_maxrss / 1024
            print(f"{fmt}: {samples} samples, {len(report['files'])} files, {mib:.1f} MiB in "
                  f"{wall:.1f}s = {samples / wall:,.0f} samples/s, {mib / wall:.1f} MiB/s; "
                  f"peak RSS {peak:.0f} MiB ({'OK' if peak < 1024 else 'OVER'} < 1024 MiB)")


if __name__ == "__main__":
    main()
