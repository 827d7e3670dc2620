"""Full-attention versus sliding-window draft layers, side by side in one run.

Run: ``.venv/bin/python benchmarks/drafter_shapes.py [--model tiny-qwen3] [--window 32]
[--steps 6] [--prompts 4] [--max-new-tokens 256] [--repeats 3]``.
Builds two drafters of the same shape and init on the target, one with every layer
``full_attention`` and one with five ``sliding_attention`` layers (``--window``, below the
rows' length), and times in alternating rounds (best round each): a training step on the same
packed rows (demo replies of the target, longer than the window) and the speculative-decoding
eval loop (tokens/s, checked equal to greedy decoding). Prints each side's figure and the
ratio sliding / full. On CPU by default, one thread; the window's saving grows with the
context (thinking traces of tens of thousands of tokens), the figures here are for short rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from embedded.demo_rows import demo_rows, mt_bench_prompts  # noqa: E402
from workers.train.drafter.features import with_target_features  # noqa: E402
from workers.train.drafter.model import (  # noqa: E402
    SLIDING,
    DFlashConfig,
    DFlashDraftModel,
    add_mask_token,
)
from workers.train.drafter.specdec import (  # noqa: E402
    DFlashProposer,
    greedy_generate,
    speculative_generate,
)
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402
from workers.train.evaluation import encode_prompt, stop_ids  # noqa: E402

MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


def drafters(target, mask_id: int, window: int) -> dict[str, DFlashDraftModel]:  # noqa: ANN001
    base = DFlashConfig.from_target(target.config, mask_id)
    shapes = {"full": base, "sliding": replace(base, layer_types=(SLIDING,) * 5,
                                               sliding_window=window)}
    return {name: DFlashDraftModel(config, target.get_input_embeddings(),
                                   target.get_output_embeddings(), init_seed=0)
            for name, config in shapes.items()}


def time_steps(trainers: dict, rows: list, steps: int, repeats: int) -> dict[str, float]:
    """Best-round seconds per training step of each side, same rows, alternating order."""
    best = dict.fromkeys(trainers, float("inf"))
    for round_ in range(repeats):
        for name in (sorted(trainers) if round_ % 2 == 0 else sorted(trainers, reverse=True)):
            started = time.perf_counter()
            for step in range(steps):
                first = (step * 4) % max(1, len(rows) - 4)
                trainers[name].step(rows[first:first + 4])
            best[name] = min(best[name], (time.perf_counter() - started) / steps)
    return best


def time_decoding(target, models: dict, prompts: list, budget: int, stops: set,  # noqa: ANN001
                  repeats: int) -> dict[str, float]:
    """Best-round tokens/s of the speculative loop with each drafter; lossless checked."""
    greedy = [greedy_generate(target, p, budget, stops).tokens for p in prompts]
    best = dict.fromkeys(models, 0.0)
    for round_ in range(repeats):
        for name in (sorted(models) if round_ % 2 == 0 else sorted(models, reverse=True)):
            proposer = DFlashProposer(models[name].eval())
            started, tokens = time.perf_counter(), 0
            for prompt, expected in zip(prompts, greedy, strict=True):
                out = speculative_generate(target, proposer, prompt,
                                           models[name].config.target_layer_ids, budget, stops)
                assert out.tokens == expected, f"{name}: not the target's greedy output"
                tokens += len(out.tokens)
            best[name] = max(best[name], tokens / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_target(resolve_model_path(load_settings(model=args.model)))
    mask_id = add_mask_token(tokenizer, target)
    models = drafters(target, mask_id, args.window)
    layers = models["full"].config.target_layer_ids
    rows = [r for r in with_target_features(
        target, demo_rows(target, tokenizer, mt_bench_prompts(MT_BENCH, 24), seed=0,
                          max_new_tokens=args.max_new_tokens), layers)
        if len(r.row.input_ids) > 2 * args.window]
    lengths = sorted(len(r.row.input_ids) for r in rows)
    trainers = {name: DrafterTrainer(m, TrainConfig(total_steps=10_000, max_anchors=32))
                for name, m in models.items()}
    step_s = time_steps(trainers, rows, args.steps, args.repeats)
    texts = mt_bench_prompts(MT_BENCH, 80)[-args.prompts:]
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": t}], True) for t in texts]
    per_s = time_decoding(target, models, prompts, args.max_new_tokens,
                          stop_ids(target, tokenizer), args.repeats)
    print(f"{args.model}: {len(rows)} rows of {lengths[0]}-{lengths[-1]} tokens (median "
          f"{lengths[len(lengths) // 2]}), window {args.window}, best of {args.repeats} rounds")
    full, sliding = step_s["full"], step_s["sliding"]
    print(f"training step   full {full * 1000:8.1f} ms   sliding {sliding * 1000:8.1f} ms   "
          f"sliding/full {sliding / full:.3f}")
    full, sliding = per_s["full"], per_s["sliding"]
    print(f"eval loop       full {full:8.1f} tok/s sliding {sliding:8.1f} tok/s   "
          f"sliding/full {sliding / full:.3f} (lossless: checked)")


if __name__ == "__main__":
    main()
