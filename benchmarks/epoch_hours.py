"""An epoch's hours as the plan counts them beside an epoch actually trained, on the CPU.

Run: ``.venv/bin/python benchmarks/epoch_hours.py [--rows 32] [--anchors 64]`` (the embedded tiny
targets, one thread, a few minutes).

The plan's side is the product's own: :class:`common.plan.verdict.TrainingPlan` for the tiny
target and its drafter, its FLOPs (:mod:`common.plan.compute`) at the rate this CPU's float32
matmul measures at utilization 1.0 (``--utilization``), accounted step by step by the train
worker's :class:`workers.train.pace.EpochPace` over the steps trained; the measured side is the
same pace's steps' wall time (target features on the fly, the drafter's forward and backward,
the optimizer), both times the epoch's steps (the first step, a warm-up, left out of both). The
rate is the median of samples taken after every step, so the load of a shared machine weighs on
both sides alike.
Printed per target: planned and measured hours, measured / planned, and where the time went:
the target's forward (timed apart) against its planned share, and the rest against the plan
with the CPU's dense attention counted (each row goes alone, ``--batch-tokens 1``; the CPU's
drafter attends every query to every key of its micro-batch under a mask, ``Q x (T + Q)``,
where the plan counts each block over its half row as a GPU's flex attention computes it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.choices import Checkpointing  # noqa: E402
from common.plan.compute import RowLength, target_flops  # noqa: E402
from common.plan.shapes import DrafterDims, TargetDims  # noqa: E402
from common.plan.verdict import Hardware, TrainingPlan  # noqa: E402
from common.runs.trainrows import TrainingRow  # noqa: E402
from workers.train.drafter.features import target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402
from workers.train.memory import CPU_BATCH_TOKENS  # noqa: E402
from workers.train.pace import EpochPace  # noqa: E402


def matmul_flops_per_s(size: int = 1024, seconds: float = 2.0) -> float:
    """This CPU's float32 matmul rate: ``size`` square products, timed for ``seconds``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)   # warm-up
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        done += 1
    return done * 2.0 * size**3 / (time.perf_counter() - started)


def rows_of(count: int, low: int, high: int, vocab: int) -> list[TrainingRow]:
    """``count`` rows from ``low`` to ``high`` tokens, a 16-token prompt each."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        n = low + (high - low) * i // max(1, count - 1)
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        rows.append(TrainingRow(f"r{i}", 0, ids, [0] * 16 + [1] * (n - 16)))
    return rows


def dense_attention_flops(drafter: DrafterDims, lengths: list[RowLength], anchors: int) -> float:
    """What the CPU's dense attention adds to the plan's: per row alone, every query against
    the row's context and all its blocks, forward and backward (3 passes), in every layer."""
    extra = 0.0
    for row in lengths:
        t = row.tokens
        q = min(anchors, row.supervised - 1) * drafter.block_size
        dense, planned = q * (t + q), q * (t / 2 + drafter.block_size)
        extra += 3 * 4.0 * drafter.num_hidden_layers * drafter.q_width * (dense - planned)
    return extra


def measure(target: Any, rows: list[TrainingRow], args: argparse.Namespace) -> dict[str, Any]:
    """One epoch of ``rows`` trained, the matmul rate sampled after every step (the load of a
    shared machine moves both); the pace's planned and measured hours at the median rate."""
    mask_id = target.get_input_embeddings().num_embeddings - 1
    drafter = DFlashDraftModel.for_target(target, mask_id, init_seed=0)
    layers = tuple(drafter.config.target_layer_ids)
    spent = [0.0]

    def featurize(batch: list[TrainingRow]) -> list[torch.Tensor]:
        started = time.perf_counter()
        features = target_features(target, batch, layers)
        spent[0] += time.perf_counter() - started
        return features

    steps = math.ceil(len(rows) / args.rows_per_step)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=steps, max_anchors=args.anchors),
                             featurize, args.batch_tokens)
    trained, rates = [], [matmul_flops_per_s()]
    for first in range(0, len(rows), args.rows_per_step):
        part = rows[first:first + args.rows_per_step]
        spent[0] = 0.0
        metrics = trainer.step(part)
        trained.append((part, metrics.seconds, spent[0]))
        rates.append(matmul_flops_per_s(seconds=0.5))
    rate = statistics.median(rates)
    dims, drafter_dims = TargetDims.of_model(target), DrafterDims.from_config(drafter.config)
    plan = TrainingPlan(dims, drafter_dims, Hardware(64, cuda=False), max(len(r.input_ids)
                        for r in rows), Checkpointing.OFF, args.anchors,
                        utilization=args.utilization, tflops=rate / 1e12)
    pace = EpochPace(plan, steps_per_epoch=steps)
    for part, seconds, _ in trained:   # as the worker adds each step (the first: a warm-up)
        pace.add(part, seconds)
    planned, measured = pace.hours()
    lengths = [RowLength(len(r.input_ids), r.supervised_tokens)
               for r in rows[args.rows_per_step:]]
    planned_target = sum(target_flops(dims, n.tokens, drafter_dims.deepest_layer)
                         for n in lengths) / plan.flops_per_s
    dense = dense_attention_flops(drafter_dims, lengths, args.anchors) / plan.flops_per_s
    return {"planned": planned, "measured": measured, "steps": steps, "rate": rate,
            "rates": (min(rates), max(rates)), "wall": sum(t[1] for t in trained[1:]),
            "target_s": sum(t[2] for t in trained[1:]), "planned_target_s": planned_target,
            "planned_s": pace.planned_s, "dense_s": dense}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="rows in the epoch")
    parser.add_argument("--rows-per-step", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=64, help="blocks drawn per row")
    parser.add_argument("--batch-tokens", type=int, default=1,
                        help=f"micro-batch budget (1: each row alone; the CPU worker's "
                             f"{CPU_BATCH_TOKENS} packs a step's rows into one dense grid)")
    parser.add_argument("--utilization", type=float, default=1.0,
                        help="share of the measured matmul rate the plan assumes")
    args = parser.parse_args()
    from embedded.tinycache import CACHE_DIR, TARGETS, build_models
    from embedded.tinymodel import ensure_tiny_model
    from workers.train.drafter.target_loader import load_target

    torch.set_num_threads(1)
    build_models()
    print(f"The plan at {args.utilization:.0%} of the CPU's float32 1024^2 matmul rate (1 "
          f"thread, sampled after every step: GFLOP/s median [min-max]). An epoch of "
          f"{args.rows} rows of {args.min_tokens}-{args.max_tokens} tokens, "
          f"{args.rows_per_step} rows a step, {args.anchors} anchors, micro-batches of "
          f"{args.batch_tokens} tokens")
    print(f"  {'target':<13} {'GFLOP/s':>15} {'steps':>5} {'planned h':>10} {'measured h':>11} "
          f"{'meas/plan':>9} | target forward s meas/plan; the rest s: meas/plan, "
          "meas/(plan + the CPU's dense attention)")
    for name in TARGETS:
        target, tokenizer = load_target(ensure_tiny_model(CACHE_DIR, name))
        add_mask_token(tokenizer, target)
        target.requires_grad_(False)
        vocab = target.get_input_embeddings().num_embeddings - 1
        r = measure(target, rows_of(args.rows, args.min_tokens, args.max_tokens, vocab), args)
        low, high = r["rates"]
        rate = f"{r['rate'] / 1e9:.0f} [{low / 1e9:.0f}-{high / 1e9:.0f}]"
        rest, planned_rest = r["wall"] - r["target_s"], r["planned_s"] - r["planned_target_s"]
        print(f"  {name:<13} {rate:>15} {r['steps']:>5} {r['planned']:>10.3g} "
              f"{r['measured']:>11.3g} {r['measured'] / r['planned']:>9.2f} | {r['target_s']:.2f}/"
              f"{r['planned_target_s']:.2f} = {r['target_s'] / r['planned_target_s']:.2f}; "
              f"{rest:.2f}/{planned_rest:.2f} = {rest / planned_rest:.2f}, "
              + (f"{rest / (planned_rest + r['dense_s']):.2f}" if args.batch_tokens == 1
                 else "- (rows packed: a larger grid)"))


if __name__ == "__main__":
    main()
