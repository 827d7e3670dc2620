"""Speculative decoding versus plain greedy decoding of the target, and tau versus the estimate.

Run: ``.venv/bin/python benchmarks/speculative_decoding.py [--model PATH] [--steps 100 400]
[--prompts 16] [--max-new-tokens 256] [--repeats 3]``, or ``--rollbacks`` for the loop's speed on
the dense and the hybrid tiny target side by side (below).
Trains a drafter on demo rows of the target (64 MT-Bench prompts, seeded) and, untrained and
after each ``--steps`` count, decodes ``--prompts`` other MT-Bench prompts (never trained on)
both ways in alternating timed rounds: the speculative loop and greedy decoding, one token per
target forward over the same KV cache. Both must give the same tokens (checked). Prints, per
drafter, wall time per generated token of each side (best round) and their ratio, the measured
acceptance length tau, target forwards per token, and the training estimate (``acceptance_length``
from per-slot accuracies on held-out rows) next to tau. On CPU by default, one thread.

``--rollbacks [--hybrid PATH]``: tokens/s of the loop on the dense ``tiny-qwen3`` and the hybrid
``tiny-qwen3.5`` (or ``--hybrid``) with an oracle drafter that gets a fixed number of drafts
per block right (none, half, all), each of the hybrid's rollbacks of linear-attention state
(``replay``, ``refeed``, ``per-token``; :mod:`workers.train.drafter.target_cache`) side by
side, next to greedy decoding; every output is checked against greedy decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from embedded.demo_rows import demo_rows, mt_bench_prompts  # noqa: E402
from workers.train.drafter.features import with_target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.specdec import (  # noqa: E402
    AcceptanceStats,
    DFlashProposer,
    greedy_generate,
    speculative_generate,
)
from workers.train.drafter.target_cache import ROLLBACKS  # noqa: E402
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402
from workers.train.evaluation import encode_prompt, stop_ids  # noqa: E402

MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


def timed_rounds(target, drafter, prompts, budget, stops, repeats):  # noqa: ANN001, ANN201
    """Best-round seconds of each side, the speculative results, and a losslessness check."""
    layer_ids = drafter.config.target_layer_ids
    best = {"spec": float("inf"), "greedy": float("inf")}
    results = []
    for round_ in range(repeats):
        order = ("spec", "greedy") if round_ % 2 == 0 else ("greedy", "spec")
        outs: dict[str, list] = {}
        for side in order:
            started = time.perf_counter()
            if side == "spec":
                outs[side] = [speculative_generate(target, DFlashProposer(drafter), p, layer_ids,
                                                   budget, stops) for p in prompts]
            else:
                outs[side] = [greedy_generate(target, p, budget, stops) for p in prompts]
            best[side] = min(best[side], time.perf_counter() - started)
        if [o.tokens for o in outs["spec"]] != [o.tokens for o in outs["greedy"]]:
            raise SystemExit("speculative decoding differs from greedy decoding: a bug")
        results = outs["spec"]
    return best, results


class Oracle:
    """Drafts from the known greedy continuation: the first ``correct`` of each block right."""

    def __init__(self, prompt: list[int], greedy: list[int], block: int, correct: int) -> None:
        self.start, self.greedy, self.block_size, self.correct = len(prompt), greedy, block, correct

    def begin(self) -> None:
        pass

    def propose(self, sequence, new_features):  # noqa: ANN001, ANN201
        at = len(sequence) - self.start
        right = self.greedy[at:at + self.block_size - 1]
        right += [0] * (self.block_size - 1 - len(right))
        return torch.tensor([t if k < self.correct else (t + 1) % 100
                             for k, t in enumerate(right)])


def best_seconds(fn, repeats: int) -> tuple[float, list]:  # noqa: ANN001
    best, out = float("inf"), []
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def rollbacks(args: argparse.Namespace) -> None:
    """The loop's tokens/s on the dense and the hybrid tiny target, per rollback and accuracy."""
    from embedded.tinymodel import ensure_tiny_model

    settings = load_settings()
    hybrid = args.hybrid or ensure_tiny_model(settings.target.cache_dir, "tiny-qwen3.5")
    print(f"{args.prompts} prompts, {args.max_new_tokens} new tokens, block {BLOCK}, best of "
          f"{args.repeats}, 1 thread; tok/s of the loop (x greedy decoding's)")
    print(f"{'target':>12} {'rollback':>10} {'greedy':>8}" + "".join(
        f" {f'{c}/{BLOCK - 1} right':>17}" for c in ACCURACIES))
    rollback_rows("tiny-qwen3", ensure_tiny_model(settings.target.cache_dir), args, ["(crop)"])
    rollback_rows("tiny-qwen3.5", hybrid, args, list(ROLLBACKS))


BLOCK = 16
ACCURACIES = (0, 7, 15)


def rollback_rows(name: str, path: str, args: argparse.Namespace, kinds: list[str]) -> None:
    target, tokenizer = load_target(path)
    budget = args.max_new_tokens
    texts = mt_bench_prompts(MT_BENCH, 64 + args.prompts)[64:]
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": t}], True) for t in texts]
    known = [greedy_generate(target, p, budget + BLOCK, set()).tokens for p in prompts]
    greedy_s, plain = best_seconds(lambda: [greedy_generate(target, p, budget, set())
                                            for p in prompts], args.repeats)
    tokens = sum(len(o.tokens) for o in plain)
    for rollback in kinds:
        cells = []
        for correct in ACCURACIES:
            seconds, outs = best_seconds(lambda c=correct, r=rollback: [speculative_generate(
                target, Oracle(p, k, BLOCK, c), p, [1], budget, set(),
                rollback=r if r in ROLLBACKS else ROLLBACKS[0])
                for p, k in zip(prompts, known, strict=True)], args.repeats)
            if [o.tokens for o in outs] != [o.tokens for o in plain]:
                raise SystemExit(f"{name} {rollback}: speculative differs from greedy: a bug")
            cells.append(f"{tokens / seconds:8.1f} ({greedy_s / seconds:5.2f}x)")
        print(f"{name:>12} {rollback:>10} {tokens / greedy_s:8.1f}" +
              "".join(f" {c:>17}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target model dir [default: tiny model]")
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollbacks", action="store_true",
                        help="the dense vs hybrid loop speed per rollback (see above)")
    parser.add_argument("--hybrid", default=None, help="hybrid model dir [default: tiny-qwen3.5]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rollbacks:
        rollbacks(args)
        return
    settings = load_settings(**({"model": args.model} if args.model else {}))
    target, tokenizer = load_target(resolve_model_path(settings))
    mask_id = add_mask_token(tokenizer, target)
    drafter = DFlashDraftModel.for_target(target, mask_id)
    layer_ids = drafter.config.target_layer_ids
    texts = mt_bench_prompts(MT_BENCH, 80)
    rows = [r for r in with_target_features(target, demo_rows(target, tokenizer, texts[:64]),
                                            layer_ids) if r.row.supervised_tokens >= 32]
    train, held_rows = rows[:-8], rows[-8:]
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": t}], True)
               for t in texts[64:64 + args.prompts]]
    stops = stop_ids(target, tokenizer)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=max(args.steps), max_anchors=16))
    judge = DrafterTrainer(drafter, TrainConfig(total_steps=1))
    print(f"{len(prompts)} held-out prompts, up to {args.max_new_tokens} new tokens, block "
          f"{drafter.config.block_size}, best of {args.repeats} alternating rounds, 1 thread")
    print(f"{'drafter':>10} {'spec ms/tok':>12} {'greedy ms/tok':>14} {'spec/greedy':>12} "
          f"{'tau':>7} {'tau pooled':>11} {'fwd/tok':>8} {'estimate':>9}")
    for steps in [0, *args.steps]:
        while trainer.steps < steps:
            first = (trainer.steps * 4) % (len(train) - 4)
            trainer.step(train[first:first + 4])
        best, results = timed_rounds(target, drafter, prompts, args.max_new_tokens, stops,
                                     args.repeats)
        stats = AcceptanceStats.of(results, drafter.config.block_size)
        estimate = judge.evaluate(held_rows).acceptance_length
        spec_ms, greedy_ms = (1000 * best[s] / stats.tokens for s in ("spec", "greedy"))
        label = "untrained" if steps == 0 else f"{steps} steps"
        print(f"{label:>10} {spec_ms:12.2f} {greedy_ms:14.2f} {spec_ms / greedy_ms:12.2f} "
              f"{stats.tau:7.3f} {stats.tau_pooled:11.3f} "
              f"{stats.target_forwards_per_token:8.3f} {estimate:9.3f}")


if __name__ == "__main__":
    main()
