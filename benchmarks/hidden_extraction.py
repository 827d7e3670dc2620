"""Hidden-state extraction speed versus a plain forward loop, and padding with length batching.

Run: ``.venv/bin/python benchmarks/hidden_extraction.py [--model PATH] [--rows 200]``.
Builds rows of random token ids with lognormal lengths, batches them with
:func:`workers.batching.length_batches`, then times, on the same batches and interleaved,
``HiddenExtractor.extract`` (forward, layer concat, NaN/shape/id checks, slicing, copy to CPU)
against a plain loop that pads the batch and calls ``model(input_ids, attention_mask,
output_hidden_states=True)`` and nothing else (and the same loop over the decoder stack alone,
without the LM head that the extractor skips, to isolate its own overhead). Prints tokens/s and
the ratio extractor/plain (target >= 0.95), and the padding waste with length batching versus
plain input-order batching (target <= 5%). Defaults to the embedded tiny model on CPU;
``--model`` takes any local HF directory.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.runs.trainrows import TrainingRow  # noqa: E402
from workers.batching import length_batches  # noqa: E402
from workers.hidden.extraction import ExtractorConfig, HiddenExtractor  # noqa: E402


def make_rows(count: int, vocab: int, mu: float, sigma: float, max_len: int,
              seed: int) -> list[TrainingRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = max(16, min(max_len, int(rng.lognormvariate(mu, sigma))))
        prompt = n // 3
        rows.append(TrainingRow(f"b{i}", 0, [rng.randrange(vocab) for _ in range(n)],
                                [0] * prompt + [1] * (n - prompt)))
    return rows


def plain_forward(model: torch.nn.Module, batch: list[TrainingRow], device: torch.device) -> None:
    """What a hand-written loop does per batch: pad, forward with hidden states, nothing else."""
    with torch.inference_mode():
        ids = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(r.input_ids) for r in batch], batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(
            [torch.ones(len(r.input_ids), dtype=torch.long) for r in batch], batch_first=True)
        model(input_ids=ids.to(device), attention_mask=mask.to(device),
              output_hidden_states=True, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(extractor: HiddenExtractor, batches: list[list[TrainingRow]],
            repeats: int) -> dict[str, float]:
    """Best seconds per batch and path, summed; the paths run back to back on each batch in a
    rotating order, so load from other processes hits them alike."""
    paths = {
        "plain": lambda b: plain_forward(extractor.model, b, extractor.device),
        "decoder": lambda b: plain_forward(extractor.backbone, b, extractor.device),
        "ours": extractor.extract,
    }
    names = list(paths)
    best = {name: [float("inf")] * len(batches) for name in names}
    for rep in range(repeats):
        for i, batch in enumerate(batches):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                paths[name](batch)
                best[name][i] = min(best[name][i], time.perf_counter() - started)
    return {name: sum(times) for name, times in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory [default: tiny].")
    parser.add_argument("--layout", default="dflash", choices=["dflash", "eagle3"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--mu", type=float, default=6.0, help="lognormal mean of log length")
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = args.model
    if path is None:
        from embedded.tinymodel import ensure_tiny_model

        path = str(ensure_tiny_model(load_settings().target.cache_dir))
    extractor = HiddenExtractor(ExtractorConfig(path, layout=args.layout, device=args.device))
    rows = make_rows(args.rows, extractor.vocab_size, args.mu, args.sigma, args.max_len,
                     args.seed)
    batches, stats = length_batches(rows, args.max_tokens, args.max_rows)
    _, plain_stats = length_batches(rows, args.max_tokens, args.max_rows, max_waste=None,
                                    sort=False)
    print(f"model {path} on {extractor.device} ({extractor.dtype}), layout {args.layout} "
          f"layers {extractor.layer_ids}, torch threads {torch.get_num_threads()}")
    print(f"rows {stats.rows}, real tokens {stats.real_tokens:,}, max_tokens {args.max_tokens},"
          f" max_rows {args.max_rows}")
    print(f"padding waste: length batching {100 * stats.waste:.1f}% ({stats.batches} batches), "
          f"input order {100 * plain_stats.waste:.1f}% ({plain_stats.batches} batches); "
          f"target <= 5%: {'ok' if stats.waste <= 0.05 else 'MISSED'}")

    measure(extractor, batches[:2], 1)  # warm up every path (allocator, kernels, threads)
    # "plain": the full model as a hand-written loop calls it (the target's baseline);
    # "decoder": the same decoder stack without the LM head, to show our own overhead alone.
    best = measure(extractor, batches, args.repeats)
    tokens = stats.real_tokens
    for name, label in (("plain", "plain forward loop"), ("decoder", "plain decoder-only loop"),
                        ("ours", "HiddenExtractor")):
        print(f"{label + ':':25s}{tokens / best[name]:12,.0f} tok/s ({best[name]:.2f} s)")
    ratio = best["plain"] / best["ours"]
    print(f"ratio extractor/plain: {ratio:.3f} (target >= 0.95: "
          f"{'ok' if ratio >= 0.95 else 'MISSED'}); extractor/decoder-only: "
          f"{best['decoder'] / best['ours']:.3f} (our slicing, checks and copies alone)")

if __name__ == "__main__":
    main()
