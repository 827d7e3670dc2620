"""Generation through the target's MTP head vs without, on the simulator's modelled GPU: output
tokens/s at a memory-bound and at a compute-bound batch, side by side in one run, and the hours
each would take at the seed's size (902,087 samples) on 8 GPUs.

Run: ``.venv/bin/python benchmarks/mtp_speed.py [--small 4] [--large 256] [--rounds 1]
[--tokens-per-sample 3900] [--accept-length 2.5]``.

Each configuration's engine is started exactly as a generate worker starts it
(:func:`common.engine.serving.engine_command` with ``--engine-cmd "python -m
embedded.simulator ... {engine_args}"`` and :func:`common.engine.mtp.choose_mtp` on Qwen3.6-27B's
shape: ``--mtp off``, then ``--mtp on``: NEXTN, 3 steps, top-1, 4 tokens verified per step, the
hybrid's mamba cache strategy, the running cap), under the worker's supervisor
(:mod:`producer.bench_engine`). The simulator's default latency model: a 2 ms step plus 0.05 ms per
token decoded or verified, 0.2 ms per draft step, ``--accept-length`` tokens per verify step
(SGLang's Qwen3.5 MTP reports 2.5-3.5 on thinking traces). At a small batch the fixed part of a
step dominates, so a step that verifies 4 tokens per request costs little more than one that
decodes 1, and emits 2.5; at a large batch the verified tokens dominate and MTP loses. The hours
are the projection ``bench --run`` prints (:mod:`producer.projection`) with ``--tokens-per-sample``
output tokens a sample (default 3,900: the mean of benchmarks/seed_run.py's realistic counts) and
one engine per GPU. A timing benchmark: here, never asserted in tests/ (tests/test_bench_run.py
asserts only which configuration wins).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import load_settings  # noqa: E402
from common.engine.mtp import choose_mtp  # noqa: E402
from common.engine.serving import engine_command  # noqa: E402
from common.engine.target import TargetShape  # noqa: E402
from producer.bench import BenchRow, measure, synthetic_bodies  # noqa: E402
from producer.bench_engine import free_port, launched  # noqa: E402
from producer.projection import SEED_SAMPLES, project  # noqa: E402

SHAPE = ROOT / "benchmarks" / "shapes" / "qwen3.6-27b.json"


def rows_of(mode: str, levels: list[int], args: argparse.Namespace) -> list[BenchRow]:
    """One engine per configuration, every concurrency measured on it."""
    sim = (f"{sys.executable} -m embedded.simulator --host 127.0.0.1 --port {{port}} "
           f"--model-path {{model}} --max-running {max(levels)} --accept-length "
           f"{args.accept_length} --seed 1 {{engine_args}}")
    settings = load_settings({}, engine="sglang", engine_cmd=sim, mtp=mode)
    choice = choose_mtp(settings, TargetShape.from_dict(json.loads(SHAPE.read_text())))
    print(choice.line())
    port = free_port()
    argv = engine_command(replace(settings, max_in_flight=max(levels)), SHAPE.parent,
                          choice.args, port=port)
    rows = []
    with launched(argv, f"http://127.0.0.1:{port}", Path(args.log_dir), 60) as url:
        for level in levels:
            bodies = synthetic_bodies(level * args.waves, 64, 2048, seed=level)
            rows.append(asyncio.run(measure(url, level, bodies, mode)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=4, help="a memory-bound batch")
    parser.add_argument("--large", type=int, default=256, help="a compute-bound batch")
    parser.add_argument("--waves", type=int, default=4, help="requests per concurrency slot")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--accept-length", type=float, default=2.5)
    parser.add_argument("--tokens-per-sample", type=float, default=3900)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--log-dir", default="/tmp/dflash-mtp-speed")
    args = parser.parse_args()
    levels = [args.small, args.large]
    rates: dict[tuple[str, int], list[float]] = {}
    accept: list[float] = []
    for _ in range(args.rounds):
        for mode in ("off", "on"):   # both engines in every round, one after the other
            for row in rows_of(mode, levels, args):
                rates.setdefault((mode, row.concurrency), []).append(row.tokens_per_s)
                if row.accept_length is not None:
                    accept.append(row.accept_length)
    print(f"\n{'batch':<14} {'concurrency':>11} {'off tok/s':>10} {'on tok/s':>10} "
          f"{'on/off':>7} {'hours off':>10} {'hours on':>9}   ({args.gpus} GPUs, "
          f"{SEED_SAMPLES:,} samples x {args.tokens_per_sample:,.0f} tokens)")
    for name, level in (("memory-bound", args.small), ("compute-bound", args.large)):
        off, on = (statistics.median(rates[(m, level)]) for m in ("off", "on"))
        rows = [BenchRow(level, 1, round(off * 1000), 1000.0, 0, 0, mtp="off"),
                BenchRow(level, 1, round(on * 1000), 1000.0, 0, 0, mtp="on")]
        hours = project(rows, SEED_SAMPLES, (1, int(args.tokens_per_sample)), 1.0,
                        args.gpus).hours
        print(f"{name:<14} {level:>11} {off:>10,.0f} {on:>10,.0f} {on / off:>7.2f} "
              f"{hours['off']:>10,.1f} {hours['on']:>9,.1f}")
    print(f"accept length measured: {statistics.median(accept):.2f} tokens per verify step")


if __name__ == "__main__":
    main()
