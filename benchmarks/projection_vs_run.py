"""``bench --run``'s projected time for a run of prompts it never saw vs that run's wall time,
engine start included, MTP off and on, each side repeated; the spread of the ratio.

Run: ``.venv/bin/python benchmarks/projection_vs_run.py [--rows 48] [--num 24] [--in-flight 8]
[--repeats 3] [--time-scale 1]``.

On the simulator's modelled GPU (the tiny hybrid target, which states an MTP head): MT-Bench's
first ``--num`` two-turn conversations are enqueued as the bench's run and the next ``--rows``
as the run that is generated, so the bench never sees the generated prompts (the simulator fixes
each reply's length by its prompt: the same prompts would make the bench's conversations exactly
the run's). For each configuration and repeat, ``bench --run`` measures the bench's run with
that ``--mtp`` (closed loop at ``--in-flight``), and its projection (output tokens per
conversation / output tokens per second) gives the generated run's seconds; then a fresh generate
worker with that ``--mtp`` and ``--max-in-flight`` generates the run, timed from the worker's
launch (its engine's start included) to the last commit. Printed per repeat: projected, actual
(and of it the worker's start to ready) and projected / actual (1.00: the projection is the
run's own time); per configuration the ratio's min / median / max; and which configuration is
faster by the projections' and by the runs' medians. A timing benchmark: never asserted in
tests/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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
SHARD = 8   # conversations per shard of the generated run
BENCHED = "proj-bench"


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


def enqueue(env: dict[str, str], run: str, src: Path, shard_size: int) -> None:
    cli(env, "enqueue", "--input", str(src), "--run", run, "--shard-size", str(shard_size),
        "--max-new-tokens", "2048", "--max-reject-rate", "1", "--skip-gate", "duplicates")


def projected(mode: str, args: argparse.Namespace, env: dict[str, str]) -> float:
    """The generated run's seconds as the bench of the other prompts projects them."""
    bench = json.loads(cli(env, "bench", "--run", BENCHED, "--engine", "sglang",
                           "--engine-cmd", sim_cmd(args.time_scale), "--mtp", mode,
                           "--concurrency", str(args.in_flight), "--num", str(args.num),
                           "--gpus", "1", "--json"))
    projection = bench["projection"]
    return (args.rows * projection["output_tokens_per_sample"]
            / projection["output_tokens_per_s"][mode])


def generated(mode: str, repeat: int, args: argparse.Namespace, env: dict[str, str],
              work: Path) -> tuple[float, float]:
    """(seconds from the worker's launch to the run's last commit, of them to its ready)."""
    run = f"proj-{mode}-{repeat}"
    enqueue(env, run, work / "run.jsonl", SHARD)
    shards = math.ceil(args.rows / SHARD)
    log = work / f"worker-{run}.log"
    started = time.perf_counter()
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate", "--engine", "sglang",
             "--engine-cmd", sim_cmd(args.time_scale), "--mtp", mode,
             "--max-in-flight", str(args.in_flight), "--concurrency", "2", "--name",
             f"{run}@%h", "--loglevel", "INFO"],
            env={**env, "DFLASH_ENGINE_PORT": str(free_port())}, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait(lambda: " ready." in log.read_text(), 600, "the worker")
        ready = time.perf_counter() - started
        commits = work / "storage" / "runs" / run / "generated"
        wait(lambda: len(list(commits.glob("*/_COMMIT.json"))) >= shards, 7200, f"run {run}")
        return time.perf_counter() - started, ready
    finally:
        worker.terminate()
        worker.wait(timeout=120)


def spread(values: list[float]) -> str:
    return (f"min {min(values):.2f} median {statistics.median(values):.2f} "
            f"max {max(values):.2f}")


def report(results: list[dict]) -> None:
    print(f"{'mtp':<4} {'repeat':>6} {'projected s':>12} {'actual s':>9} {'ready s':>8} "
          f"{'projected/actual':>17}")
    for r in results:
        print(f"{r['mode']:<4} {r['repeat']:>6} {r['projected_s']:>12.1f} {r['actual_s']:>9.1f} "
              f"{r['ready_s']:>8.1f} {r['projected_s'] / r['actual_s']:>17.2f}")
    medians = {}
    for mode in ("off", "on"):
        mine = [r for r in results if r["mode"] == mode]
        ratios = [r["projected_s"] / r["actual_s"] for r in mine]
        print(f"mtp {mode}: projected/actual {spread(ratios)} over {len(mine)} repeats")
        medians[mode] = (statistics.median(r["projected_s"] for r in mine),
                         statistics.median(r["actual_s"] for r in mine))
    print(f"faster by the projections' median: mtp {min(medians, key=lambda m: medians[m][0])}; "
          f"by the runs' median: mtp {min(medians, key=lambda m: medians[m][1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=48, help="conversations the run generates")
    parser.add_argument("--num", type=int, default=24,
                        help="conversations the bench runs (other prompts than the run's)")
    parser.add_argument("--in-flight", type=int, default=8, help="the worker's --max-in-flight")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (>= 3)")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    lines = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    if args.num + args.rows > len(lines) or args.repeats < 3:
        parser.error(f"need --num + --rows <= {len(lines)} (MT-Bench's questions, none shared) "
                     "and --repeats >= 3")
    model = resolve_model_path(load_settings({}, model=TINY_QWEN3_5))   # built on first use
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, chosen in (("bench", lines[:args.num]),
                             ("run", lines[args.num:args.num + args.rows])):
            (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
        redis_port = free_port()
        redis = start_redis(work / "redis", redis_port)
        env = dict(os.environ, DFLASH_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
                   DFLASH_STORAGE=str(work / "storage"), DFLASH_MODEL=str(model),
                   PYTHONPATH=str(ROOT))
        results = []
        try:
            enqueue(env, BENCHED, work / "bench.jsonl", args.num)
            for repeat in range(1, args.repeats + 1):
                for mode in ("off", "on"):   # interleaved: a load that drifts hits both
                    guess = projected(mode, args, env)
                    actual, ready = generated(mode, repeat, args, env, work)
                    results.append({"mode": mode, "repeat": repeat, "projected_s": guess,
                                    "actual_s": actual, "ready_s": ready})
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            redis.terminate()
            redis.wait(timeout=30)
    report(results)


if __name__ == "__main__":
    main()
