"""Data-parallel drafter training on CPU: tokens/s of 2 gloo ranks vs 1, and the step's
communication share.

Run: ``.venv/bin/python benchmarks/data_parallel.py [--steps 16] [--rows-per-step 8]``.
Starts ``torch.distributed.run`` twice (1 rank, then 2 ranks), each rank pinned to its own
core with one thread, on the embedded tiny target; the global batch (rows per step) is the
same in both. Rows are seeded random token sequences (128-256 tokens, 32 anchors each;
compute does not depend on the values) and every step computes their target features on the
fly, as the train worker does. 1 rank runs the plain trainer; 2 ranks run
:class:`workers.train.parallel.DataParallelTrainer`. Reports training tokens/s (context
tokens of the global batch per second of step wall time) and, for 2 ranks, the share of a
step that the gradient all-reduce costs (one in-place all-reduce per gradient after the ranks
agreed the step went through, not overlapped with the backward): steps alternate in blocks
with and without it, ``1 - median(without) / median(with)``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from common.engine.target import TargetShape  # noqa: E402
from common.runs.trainrows import TrainingRow  # noqa: E402
from workers.train import parallel, process_group  # noqa: E402
from workers.train.drafter.features import target_features, with_target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402

WARMUP, BLOCK = 2, 2   # untimed steps; steps per sync / no_sync block
ANCHORS = 32          # per row: the dense CPU attention mask grows with anchors x tokens


def synced(step: int) -> bool:
    """Steps alternate in blocks: the gradients' all-reduce on, then off."""
    return (step // BLOCK) % 2 == 0


def rows_for(step: int, count: int, vocab: int) -> list[TrainingRow]:
    gen = torch.Generator().manual_seed(step)
    rows = []
    for i in range(count):
        prompt, answer = 32, int(torch.randint(96, 224, (1,), generator=gen))
        ids = torch.randint(0, vocab, (prompt + answer,), generator=gen).tolist()
        rows.append(TrainingRow(f"{step}-{i}", 0, ids, [0] * prompt + [1] * answer))
    return rows


def rank_main(steps: int, rows_per_step: int) -> None:
    """One rank under the launcher: pinned, one thread; rank 0 prints its JSON figures."""
    local = int(os.environ["LOCAL_RANK"])
    os.sched_setaffinity(0, {local % os.cpu_count()})
    torch.set_num_threads(1)
    group = process_group.init_group()
    target, tokenizer = load_target(resolve_model_path(load_settings()))
    target.requires_grad_(False)
    drafter = DFlashDraftModel.for_target(target, add_mask_token(tokenizer, target))
    plain = DrafterTrainer(drafter, TrainConfig(total_steps=1000, max_anchors=ANCHORS))
    layers = list(drafter.config.target_layer_ids)
    vocab = TargetShape.of(target).vocab_size
    if group.world == 1:
        def step(s: int) -> tuple[int, float]:
            started = time.perf_counter()
            metrics = plain.step(with_target_features(target, rows_for(s, rows_per_step, vocab),
                                                      layers))
            return metrics.tokens, time.perf_counter() - started
    else:
        if group.rank:
            group.receive()   # the session message rank 0's distribute sends
        plain.featurize = functools.partial(target_features, target, layer_ids=layers)
        trainer = parallel.distribute(plain, "bench")
        reduce = trainer._reduce   # the gradients' all-reduce after the ranks agreed

        def step(s: int) -> tuple[int, float]:
            # Blocks without the all-reduce give the step's communication share (below).
            trainer._reduce = reduce if synced(s) else lambda: None
            started = time.perf_counter()
            if group.rank:
                trainer.train_part(*group.receive()[2:])
                return 0, 0.0
            metrics = trainer.step(rows_for(s, rows_per_step, vocab))
            return metrics.tokens, time.perf_counter() - started

    timed = [step(s) for s in range(WARMUP + steps)][WARMUP:]
    if group.rank:
        return
    real = [(n, t) for i, (n, t) in enumerate(timed) if group.world == 1 or synced(i + WARMUP)]
    result = {"ranks": group.world,
              "tokens_per_s": sum(n for n, _ in real) / sum(t for _, t in real),
              "step_s": statistics.median(t for _, t in real),
              "params": sum(p.numel() for p in drafter.parameters() if p.requires_grad)}
    if group.world > 1:
        result["step_no_sync_s"] = statistics.median(
            t for i, (_, t) in enumerate(timed) if not synced(i + WARMUP))
        result["comm_share"] = 1 - result["step_no_sync_s"] / result["step_s"]
    print("RESULT " + json.dumps(result), flush=True)


def launch(ranks: int, steps: int, rows_per_step: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(Path(__file__).resolve()), "--rank", "--steps", str(steps),
         "--rows-per-step", str(rows_per_step)],
        cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"{ranks} rank(s) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows-per-step", type=int, default=8)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.steps, args.rows_per_step)
        return
    one = launch(1, args.steps, args.rows_per_step)
    two = launch(2, args.steps, args.rows_per_step)
    print(f"drafter {one['params']:,} trainable parameters, {args.rows_per_step} rows per step, "
          f"1 thread per rank, pinned")
    print(f"1 rank : {one['tokens_per_s']:,.0f} tok/s ({one['step_s']:.3f} s/step)")
    print(f"2 ranks: {two['tokens_per_s']:,.0f} tok/s ({two['step_s']:.3f} s/step): "
          f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x; all-reduce share of a step "
          f"{two['comm_share']:.1%} (no_sync step {two['step_no_sync_s']:.3f} s)")


if __name__ == "__main__":
    main()
