"""``bench --run``'s projected hours vs the run's own wall time, MTP on and off, side by side.

Run: ``.venv/bin/python benchmarks/projection_vs_run.py [--rows 80] [--num 24] [--in-flight 8]
[--time-scale 1]``.

On the simulator's modelled GPU (the tiny hybrid target, which states an MTP head), for each
configuration: a run of ``--rows`` MT-Bench conversations (two turns each) is enqueued; ``bench
--run`` measures it before it starts (``--num`` of its conversations, every turn, closed loop at
the worker's ``--in-flight``, MTP off and on) and projects the hours it has left on one GPU;
then one generate worker with ``--mtp`` set to that configuration and the same ``--max-in-flight``
generates the whole run, timed from the moment the worker is ready to the last commit. The
figure is projected / actual per configuration (1.00: the projection is the run's own time), and
the projection's winner beside the faster run. The engine's start-up and the worker's own
start-up are outside both figures. A timing benchmark: never asserted in tests/.
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

from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from embedded.tinyconsts import TINY_QWEN3_5  # noqa: E402
from producer.demo import free_port, start_redis  # noqa: E402

MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


def sim_cmd(time_scale: float) -> str:
    return (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
            f"--model-path {{model}} --len-mu 5.3 --len-sigma 0.6 --time-scale {time_scale} "
            "{engine_args}")


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "producer.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def one(mode: str, args: argparse.Namespace, env: dict[str, str], work: Path) -> dict:
    """Enqueue, bench, then run the run with ``--mtp mode``: the projection and the run."""
    run, shards = f"proj-{mode}", max(1, args.rows // 8)
    cli(env, "enqueue", "--input", str(work / "in.jsonl"), "--run", run, "--limit",
        str(args.rows), "--shard-size", str(args.rows // shards), "--max-new-tokens", "2048",
        "--max-reject-rate", "1", "--skip-gate", "duplicates")
    engine = ["--engine", "sglang", "--engine-cmd", sim_cmd(args.time_scale)]
    bench = json.loads(cli(env, "bench", "--run", run, *engine, "--concurrency",
                           str(args.in_flight), "--num", str(args.num), "--gpus", "1",
                           "--json"))
    log = work / f"worker-{mode}.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate", *engine, "--mtp", mode,
             "--max-in-flight", str(args.in_flight), "--concurrency", "2", "--name",
             f"proj-{mode}@%h", "--loglevel", "INFO"],
            env={**env, "DFLASH_ENGINE_PORT": str(free_port())}, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait(lambda: " ready." in log.read_text(), 300, "the worker")
        started = time.perf_counter()
        commits = work / "storage" / "runs" / run / "generated"
        wait(lambda: len(list(commits.glob("*/_COMMIT.json"))) >= shards, 7200, f"run {run}")
        actual = time.perf_counter() - started
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    projection = bench["projection"]
    return {"mode": mode, "projected_s": projection["hours"][mode] * 3600, "actual_s": actual,
            "best": projection["best"], "rows": bench["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=80, help="conversations per run")
    parser.add_argument("--num", type=int, default=24, help="conversations the bench runs")
    parser.add_argument("--in-flight", type=int, default=8, help="the worker's --max-in-flight")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    model = resolve_model_path(load_settings({}, model=TINY_QWEN3_5))   # built on first use
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = MT_BENCH.read_text().splitlines()
        rows = [json.loads(lines[i % len(lines)]) for i in range(args.rows)]
        (work / "in.jsonl").write_text("".join(
            json.dumps({**r, "question_id": 1000 + i}) + "\n"
            for i, r in enumerate(rows)))
        redis_port = free_port()
        redis = start_redis(work / "redis", redis_port)
        env = dict(os.environ, DFLASH_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
                   DFLASH_STORAGE=str(work / "storage"), DFLASH_MODEL=str(model),
                   PYTHONPATH=str(ROOT))
        try:
            results = [one(mode, args, env, work) for mode in ("off", "on")]
        finally:
            redis.terminate()
            redis.wait(timeout=30)
    print(f"{'mtp':<4} {'projected s':>12} {'actual s':>10} {'projected/actual':>17}")
    for r in results:
        print(f"{r['mode']:<4} {r['projected_s']:>12.1f} {r['actual_s']:>10.1f} "
              f"{r['projected_s'] / r['actual_s']:>17.2f}")
    faster = min(results, key=lambda r: r["actual_s"])["mode"]
    print(f"projection's winner: {results[0]['best']} / {results[1]['best']}; "
          f"the faster run: mtp {faster}")


if __name__ == "__main__":
    main()
