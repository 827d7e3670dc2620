"""Enqueue streams its input: wall time and peak RSS of ``enqueue`` over 1,000,000 rows.

Run: ``.venv/bin/python benchmarks/enqueue_memory.py [--rows 1000000] [--files 20]
[--shard-size 1000]``. Starts a throwaway redis-server, writes synthetic JSONL (a mix of prompt,
messages, ShareGPT, Alpaca and Dolly rows) split over ``--files`` files in one directory, runs
the real CLI on the directory in a child process and reads its peak RSS from the kernel.
Prints one line per figure; the target is peak RSS < 1 GiB.
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

from producer.demo import free_port, start_redis  # noqa: E402


def write_rows(directory: Path, rows: int, files: int) -> None:
    directory.mkdir()
    per_file = -(-rows // files)
    handles = [open(directory / f"part-{k:05d}.jsonl", "w") for k in range(files)]
    for i in range(rows):
        kind = i % 5
        if kind == 0:
            row = {"id": f"p{i}", "prompt": f"Question {i}: explain topic {i % 977} briefly."}
        elif kind == 1:
            row = {"id": f"m{i}", "messages": [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": f"Tell me about item {i}."},
                {"role": "assistant", "content": "An old answer that will be dropped."},
                {"role": "user", "content": "And why?"}]}
        elif kind == 2:
            row = {"id": f"s{i}", "conversations": [
                {"from": "human", "value": f"Summarise case {i}."},
                {"from": "gpt", "value": "old"}]}
        elif kind == 3:
            row = {"id": f"a{i}", "instruction": "Translate to French.", "input": f"item {i}",
                   "output": "old"}
        else:
            row = {"id": f"d{i}", "instruction": "Summarize.", "context": f"Paragraph {i}.",
                   "response": "old", "category": "summarization"}
        handles[i // per_file].write(json.dumps(row) + "\n")
    for handle in handles:
        handle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--shard-size", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        write_rows(work / "in", args.rows, args.files)
        size_mb = sum(p.stat().st_size for p in (work / "in").iterdir()) / 2**20
        print(f"input: {args.rows} rows in {args.files} files, {size_mb:.0f} MiB, written in "
              f"{time.perf_counter() - started:.1f}s")
        port = free_port()
        redis_proc = start_redis(work / "redis", port)
        env = dict(os.environ, DFLASH_BROKER_URL=f"redis://127.0.0.1:{port}/0",
                   DFLASH_STORAGE=str(work / "storage"))
        # Build (or find) the model first so the timing covers enqueue alone.
        subprocess.run([sys.executable, "-c", "from common.config import load_settings;"
                        "from common.engine.models import resolve_model_path;"
                        "resolve_model_path(load_settings())"], env=env, check=True, cwd=ROOT)
        out, err = work / "stdout", work / "stderr"
        try:
            started = time.perf_counter()
            with open(out, "w") as stdout, open(err, "w") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "producer.cli", "enqueue", "--input",
                     str(work / "in"), "--run", "bench", "--shard-size",
                     str(args.shard_size), "--json"],
                    env=env, cwd=ROOT, stdout=stdout, stderr=stderr,
                )
                # wait4 gives this child's own peak RSS, not that of the other children.
                _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
        finally:
            redis_proc.terminate()
            redis_proc.wait()
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"enqueue failed: {err.read_text()[-2000:]}")
        peak_mib = usage.ru_maxrss / 1024
        report = json.loads(out.read_text())
        print(f"enqueue: {report['rows']} rows, {report['shards']} shards, "
              f"{report['enqueued']} tasks queued, {report['rejected']} rejected")
        print(f"wall time: {wall:.1f}s ({report['rows'] / wall:,.0f} rows/s)")
        print(f"peak RSS: {peak_mib:.0f} MiB (target < 1024 MiB): "
              f"{'OK' if peak_mib < 1024 else 'OVER'}")


if __name__ == "__main__":
    main()
