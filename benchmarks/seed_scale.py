"""Every command that looks at a run, on a run the seed's size: wall time, requests, peak RSS.

Run: ``.venv/bin/python benchmarks/seed_scale.py [--samples 902087] [--shard-size 256]
[--latency-ms 20] [--old-timeout 240]``. Writes a synthetic run through the project's writers
(``benchmarks/seed_run.py``) into a local directory, copies its objects into moto's S3 server
on loopback, starts a throwaway redis-server, then measures each command in a fresh child
process, on local storage and on S3 behind a latency shim (a botocore hook that sleeps
``--latency-ms`` before every request and counts it), with today's code path ("new") beside
the one before commit summaries ("old", :mod:`benchmarks.seed_legacy`; stopped after
``--old-timeout`` seconds). "cold" is a fresh process's first read, "warm" its second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.seed_run import RUN, Layout, write_run  # noqa: E402
from common import keys  # noqa: E402
from common.queue import redis_keys  # noqa: E402
from common.queue.celery_app import GENERATE  # noqa: E402
from common.storage import LocalStorage  # noqa: E402
from producer.demo import free_port, start_redis  # noqa: E402

AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
       "AWS_DEFAULT_REGION": "us-east-1"}
# (figure, step, paths, Redis before it: "wipe" flushes it, "keep" leaves the monitor built)
PLAN = [("status after a Redis wipe", "status_wiped", ("old", "new"), "wipe"),
        ("monitor rebuild", "rebuild", ("old", "new"), "wipe"),
        ("status --json", "status", ("old", "new"), "keep"),
        ("resume (idle run)", "resume", ("new",), "keep"),
        ("dashboard /status + /series", "dashboard", ("old", "new"), "keep"),
        ("report --json", "report", ("old", "new"), "keep"),
        ("export-dataset --format parquet", "export", ("old", "new"), "keep")]


def upload(local: Path, bucket: str, endpoint: str) -> int:
    """Copy every object of the local run into the bucket (not timed, no shim)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    files = [p for p in local.rglob("*") if p.is_file()]

    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"data/{path.relative_to(local)}",
                          Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return len(files)


def prepare_redis(client, layout, wipe: bool) -> None:  # noqa: ANN001
    """Redis as a stopped run leaves it: parked shards, queued markers, the monitor (or not)."""
    if wipe:
        client.flushall()
    names = GENERATE.keys(RUN)
    client.hset(names.parked, mapping={keys.shard_name(s): "engine kept failing"
                                       for s in layout.parked})
    client.sadd(redis_keys.redis_runs(), RUN)


def child(step: str, path: str, storage: str, broker: str, latency_ms: float,
          out: Path, timeout: float, env: dict[str, str]) -> dict:
    """Run one step in a fresh process; its figures, or a note that it ran out of time."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "seed_steps.py"), step, path, storage,
            broker, str(latency_ms), str(out)]
    try:
        done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def show(figure: str, where: str, path: str, result: dict) -> None:
    if "timeout" in result:
        print(f"| {figure} | {where} | {path} | > {result['timeout']:.0f} s (stopped) | | |",
              flush=True)
        return
    if "error" in result:
        print(f"| {figure} | {where} | {path} | error: {result['error']} | | |", flush=True)
        return
    for label, wall, requests in result["reads"]:
        name = f"{figure} ({label})" if label else figure
        print(f"| {name} | {where} | {path} | {wall:.2f} s | {requests} | "
              f"{result['rss_mib']:.0f} MiB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=902_087)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--old-timeout", type=float, default=240.0)
    parser.add_argument("--only", choices=("local", "s3"), default=None)
    parser.add_argument("--steps", default="", help="comma-separated steps (default: all)")
    parser.add_argument("--reuse", default="", help="a local run this script wrote before "
                        "(same --samples and --shard-size): measure it instead of writing one")
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request

    with tempfile.TemporaryDirectory(prefix="seed-scale-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        local = Path(args.reuse) if args.reuse else work / "local"
        fsync, os.fsync = os.fsync, lambda fd: None  # setup only: not what is measured
        try:
            layout = (Layout.of(args.samples, args.shard_size) if args.reuse else
                      write_run(LocalStorage(str(local)), args.samples, args.shard_size))
        finally:
            os.fsync = fsync
        size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        print(f"run: {args.samples} samples, {layout.shards} shards of {args.shard_size}, "
              f"{size / 2**20:.0f} MiB, written through the project's writers "
              f"({args.reuse or 'now'}) in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        port = free_port()
        redis_proc = start_redis(work / "redis", port)
        moto_port = free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
        moto.start()
        endpoint = f"http://127.0.0.1:{moto_port}"
        os.environ.update(AWS)
        import redis

        client = redis.Redis(port=port, decode_responses=True)
        broker = f"redis://127.0.0.1:{port}/0"
        env = dict(os.environ, **AWS, AWS_ENDPOINT_URL=endpoint, PYTHONPATH=str(ROOT),
                   DFLASH_BROKER_URL=broker)
        try:
            where_list = [("local", str(local), 0.0), ("s3", "s3://seed/data", args.latency_ms)]
            if args.only:
                where_list = [w for w in where_list if w[0] == args.only]
            if any(w[0] == "s3" for w in where_list):
                started = time.perf_counter()
                count = upload(local, "seed", endpoint)
                print(f"copied {count} objects into moto S3 in "
                      f"{time.perf_counter() - started:.0f} s; S3 latency shim: "
                      f"{args.latency_ms:.0f} ms per request", flush=True)
            print(f"load average before: {os.getloadavg()}", flush=True)
            print("| figure | storage | path | wall | requests | peak RSS |", flush=True)
            print("|---|---|---|---|---|---|", flush=True)
            wanted = set(filter(None, args.steps.split(",")))
            for where, url, latency in where_list:
                for figure, step, paths, redis_state in PLAN:
                    if wanted and step not in wanted:
                        continue
                    for path in paths:
                        prepare_redis(client, layout, redis_state == "wipe")
                        if redis_state == "keep" and not client.hexists(
                                redis_keys.RunKeys(RUN).gates, "ready"):
                            child("rebuild", "new", url, broker, latency, work / "out",
                                  3600, env)
                            prepare_redis(client, layout, False)
                        out = work / f"out-{where}-{step}-{path}"
                        limit = args.old_timeout if path == "old" else 3600
                        show(figure, where, path, child(step, path, url, broker, latency,
                                                        out, limit, env))
            print(f"load average after: {os.getloadavg()}", flush=True)
        finally:
            moto.stop()
            redis_proc.kill()
            redis_proc.wait()


if __name__ == "__main__":
    main()
