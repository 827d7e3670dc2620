"""DrafterTrainer.step versus the same training step written inline, on the same batches.

Run: ``.venv/bin/python benchmarks/drafter_training.py [--model PATH] [--steps 10] [--repeats 3]``.
Generates demo rows with the target (MT-Bench prompts, seeded), computes their target features
once, then alternates timed rounds of (a) ``DrafterTrainer.step`` and (b) a bare loop doing the
same anchor sampling, packing, forward, weighted cross-entropy, backward, clipping, AdamW and
schedule steps inline, with no metrics. Both sides start from the same drafter weights and seed,
see the same batches in the same order, and must report identical losses. Prints training
tokens/s (context tokens per second) of each side, best round, and the ratio trainer/bare
(target >= 0.9), best round per side and the median of per-round ratios; rounds alternate
which side goes first, so drift on a shared machine cancels. Defaults to the embedded tiny
model on CPU (dense SDPA mask); on CUDA both sides use flex attention and bf16 autocast.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.config import load_settings  # noqa: E402
from common.engine.models import resolve_model_path  # noqa: E402
from embedded.demo_rows import demo_rows, mt_bench_prompts  # noqa: E402
from workers.train.drafter.blocks import pack_rows, sample_anchors, slot_weights  # noqa: E402
from workers.train.drafter.features import FeaturedRow, with_target_features  # noqa: E402
from workers.train.drafter.masks import dense_block_mask, flex_block_mask  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel, add_mask_token  # noqa: E402
from workers.train.drafter.target_loader import load_target  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig, lr_factor  # noqa: E402


class BareLoop:
    """The training step written out inline: what DrafterTrainer.step must not slow down."""

    def __init__(self, drafter: DFlashDraftModel, config: TrainConfig, attention: str) -> None:
        self.drafter, self.config, self.attention = drafter, config, attention
        self.device = drafter.fc.weight.device
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=config.betas,
                                     weight_decay=config.weight_decay,
                                     fused=self.device.type == "cuda")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, functools.partial(
            lr_factor, warmup=config.warmup_steps, total=config.total_steps))
        self.gen = torch.Generator().manual_seed(config.seed)
        self.weights = slot_weights(drafter.config.block_size, config.loss_gamma).to(self.device)

    def step(self, rows: list[FeaturedRow]) -> torch.Tensor:
        bs = self.drafter.config.block_size
        keep = [r for r in rows if r.row.supervised_tokens >= 2 * bs]
        anchors = [sample_anchors(torch.tensor(r.row.loss_mask), self.config.max_anchors,
                                  self.gen) for r in keep]
        b = pack_rows([r.row for r in keep], [r.features for r in keep], anchors, bs,
                      self.drafter.config.mask_token_id).to(self.device)
        if self.attention == "flex":
            mask = flex_block_mask(b.anchors, b.starts, b.tokens, bs, self.device)
        else:
            mask = dense_block_mask(b.anchors, b.starts, b.tokens, bs)
        self.drafter.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            hidden = self.drafter(b.block_ids[None], b.block_positions[None], b.features[None],
                                  b.context_positions[None], mask)[0]
            logits = self.drafter.logits(hidden.view(b.blocks, bs, -1)[b.valid]).float()
        w = self.weights[b.valid.nonzero()[:, 1]]
        loss = (F.cross_entropy(logits, b.labels[b.valid], reduction="none") * w).sum() / w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def packed_tokens(rows: list[FeaturedRow], block_size: int) -> int:
    return sum(len(r.row.input_ids) for r in rows if r.row.supervised_tokens >= 2 * block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="local HF model directory (default: the tiny model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rows-per-step", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=16, help="max anchors per row")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=6, help="rounds, alternating sides")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = Path(args.model) if args.model else resolve_model_path(load_settings())
    target, tokenizer = load_target(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = target.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    mask_id = add_mask_token(tokenizer, target)
    probe = DFlashDraftModel.for_target(target, mask_id)
    rows = demo_rows(target, tokenizer, mt_bench_prompts(ROOT / "data" / "mt_bench_question.jsonl",
                                                         args.prompts), seed=0)
    featured = with_target_features(target, rows, probe.config.target_layer_ids)
    n = args.rows_per_step
    total = args.repeats * args.steps + 2
    batches = [[featured[(i * n + j) % len(featured)] for j in range(n)] for i in range(total)]
    config = TrainConfig(total_steps=max(total, 2), max_anchors=args.anchors)
    trainer = DrafterTrainer(DFlashDraftModel.for_target(target, mask_id), config)
    bare = BareLoop(DFlashDraftModel.for_target(target, mask_id), config, trainer.attention)
    bs = probe.config.block_size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # warm-up (also checks both sides compute the same losses)
    for batch in batches[:2]:
        a, b = trainer.step(batch).loss, bare.step(batch).item()
        assert a == b, f"trainer loss {a} != bare loss {b}"
    best = {"trainer": 0.0, "bare": 0.0}
    ratios = []
    sides = {"trainer": lambda b: trainer.step(b).loss, "bare": lambda b: bare.step(b).item()}
    for r in range(args.repeats):
        chunk = batches[2 + r * args.steps: 2 + (r + 1) * args.steps]
        tokens = sum(packed_tokens(b, bs) for b in chunk)
        losses, rates = {}, {}
        order = ("trainer", "bare") if r % 2 == 0 else ("bare", "trainer")   # cancel drift
        for name in order:
            sync()
            started = time.perf_counter()
            losses[name] = [sides[name](b) for b in chunk]
            sync()
            rates[name] = tokens / (time.perf_counter() - started)
            best[name] = max(best[name], rates[name])
        assert losses["trainer"] == losses["bare"], "the two loops diverged"
        ratios.append(rates["trainer"] / rates["bare"])
        print(f"round {r}: trainer {rates['trainer']:8.0f} tokens/s, bare {rates['bare']:8.0f} "
              f"tokens/s, ratio {ratios[-1]:.3f}")
    print(f"device {device}, attention {trainer.attention}, threads {torch.get_num_threads()}, "
          f"{n} rows/step, <= {args.anchors} anchors/row, {args.steps} steps x {args.repeats}")
    print(f"best rounds: trainer {best['trainer']:.0f} tokens/s, bare loop {best['bare']:.0f} "
          f"tokens/s, ratio {best['trainer'] / best['bare']:.3f}; median round ratio "
          f"{statistics.median(ratios):.3f} (target >= 0.9)")

if __name__ == "__main__":
    main()
