"""Which target layers should feed a DFlash drafter on a hybrid target: tau after the same steps.

Run: ``.venv/bin/python benchmarks/target_layers.py [--model PATH] [--steps 200] [--rows 64]
[--prompts 8] [--max-new-tokens 128] [--strategies dflash full-attention after-full]
[--export DIR]``.
On the hybrid ``tiny-qwen3.5`` by default (8 layers, full attention at 3 and 7): for each
``--target-layers`` strategy (:func:`common.drafter.layers.resolve_target_layers`) it trains a fresh
drafter (same seed, same rows in the same order, the same number of steps) on demo rows of the
target (MT-Bench prompts, seeded), then decodes held-out MT-Bench prompts with the speculative
loop (checked lossless against greedy decoding) and prints, side by side, the layer ids, the
measured acceptance length tau, target forwards per token and the training estimate. On CPU,
one thread (torch's Gated DeltaNet fallback is faster so on a shared CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.drafter.layers import STRATEGIES, resolve_target_layers  # noqa: E402
from common.engine.target import TargetShape  # noqa: E402
from embedded.demo_rows import demo_rows, mt_bench_prompts  # noqa: E402
from workers.train.drafter.features import with_target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.specdec import DFlashProposer  # noqa: E402
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402
from workers.train.evaluation import EvalPrompt, encode_prompt, evaluate, stop_ids  # noqa: E402

MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target dir [default: tiny-qwen3.5]")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=64, help="training prompts (demo rows)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--export", default=None,
                        help="also export each drafter to EXPORT/<strategy> (for eval-drafter)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from embedded.tinymodel import ensure_tiny_model

    path = args.model or ensure_tiny_model(load_settings().target.cache_dir, "tiny-qwen3.5")
    target, tokenizer = load_target(path)
    mask_id = add_mask_token(tokenizer, target)
    shape = TargetShape.of(target)
    texts = mt_bench_prompts(MT_BENCH, args.rows + args.prompts)
    rows = demo_rows(target, tokenizer, texts[:args.rows], seed=0)
    prompts = [EvalPrompt(str(i), encode_prompt(tokenizer, [{"role": "user", "content": t}],
                                                True))
               for i, t in enumerate(texts[args.rows:])]
    stops = stop_ids(target, tokenizer)
    print(f"{shape.model_type}: {shape.num_layers} layers, full attention at "
          f"{shape.full_attention_layers}; {len(rows)} training rows, {args.steps} steps, "
          f"{len(prompts)} held-out prompts, up to {args.max_new_tokens} new tokens, 1 thread")
    print(f"{'strategy':>15} {'layers':>18} {'tau':>7} {'tau pooled':>11} {'fwd/tok':>8} "
          f"{'estimate':>9} {'lossless':>9}")
    for strategy in args.strategies:
        layers = resolve_target_layers(strategy, shape)
        featured = [r for r in with_target_features(target, rows, layers)
                    if r.row.supervised_tokens >= 32]
        held, train = featured[-4:], featured[:-4]
        drafter = DFlashDraftModel.for_target(target, mask_id, layer_ids=layers, init_seed=0)
        trainer = DrafterTrainer(drafter, TrainConfig(total_steps=args.steps, max_anchors=16))
        for step in range(args.steps):
            first = (step * 4) % (len(train) - 4)
            trainer.step(train[first:first + 4])
        estimate = DrafterTrainer(drafter, TrainConfig(total_steps=1)).evaluate(held)
        report = evaluate(target, DFlashProposer(drafter), prompts, layers,
                          args.max_new_tokens, stops, check=True)
        if args.export:
            from workers.train.drafter.export import export_drafter

            export_drafter(drafter, Path(args.export) / strategy)
        stats = report.stats
        lossless = f"{report.checked - len(report.mismatches)}/{report.checked}"
        print(f"{strategy:>15} {','.join(map(str, layers)):>18} {stats.tau:7.3f} "
              f"{stats.tau_pooled:11.3f} {stats.target_forwards_per_token:8.3f} "
              f"{estimate.acceptance_length:9.3f} {lossless:>9}", flush=True)


if __name__ == "__main__":
    main()
