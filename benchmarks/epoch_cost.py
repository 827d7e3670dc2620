"""What a second online epoch costs: the trainer's tokens/s in epoch 1 (beside generation, which
shares the machine) and in epoch 2 (alone), side by side in one run.

    .venv/bin/python benchmarks/epoch_cost.py [--prompts 24] [--model tiny-qwen3]

Runs ``dflash-pipeline demo --epochs 2`` (real Redis, a generate worker and a train worker on
the embedded CPU target, an online run) on the first N MT-Bench questions, then reads the
trainer's log: each step's context tokens/s, by the epoch its shard was read in. Every online
epoch runs the target's forward again (nothing is stored), so an epoch's cost is the target
forward plus the drafter step; epoch 1 also shares the cores with generation. Prints the
median tokens/s of each epoch, their ratio and the wall time of each epoch's steps.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^(\S+ \S+).*shard \d+: step (\d+) loss .* (\d+) tok/s")
EPOCH = re.compile(r"rows to train, .*; epoch (\d+)$")


def per_epoch(log: str) -> dict[int, list[float]]:
    """Each step's tokens/s under the epoch of the shard it trained (the last one read)."""
    epoch, rates, seen = 1, {}, set()
    for line in log.splitlines():
        found = EPOCH.search(line)
        if found:
            epoch = int(found[1])
        step = STEP.search(line)
        if step and int(step[2]) not in seen:   # a replayed step after a restart counts once
            seen.add(int(step[2]))
            rates.setdefault(epoch, []).append(float(step[3]))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--model", default="tiny-qwen3")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="epoch-cost-"))
    rows = (ROOT / "data" / "mt_bench_question.jsonl").read_text().splitlines()[:args.prompts]
    (out / "in.jsonl").write_text("\n".join(rows) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "demo", "--epochs", "2", "--no-flower", "--no-ui",
         "--input", str(out / "in.jsonl"), "--out", str(out), "--shard-size", "4",
         "--max-new-tokens", "128", "--eval-prompts", "2", "--eval-max-new-tokens", "32",
         "--model", args.model], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"demo failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    rates = per_epoch((out / "logs" / "trainer.log").read_text())
    if set(rates) < {1, 2}:
        sys.exit(f"the trainer's log has steps of epochs {sorted(rates)} only")
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(json.dumps({"model": args.model, "prompts": args.prompts,
                      "epoch1": {"steps": len(rates[1]), "median_tokens_per_s": one},
                      "epoch2": {"steps": len(rates[2]), "median_tokens_per_s": two}}))
    print(f"trainer tokens/s: epoch 1 (beside generation) {one:.0f}, epoch 2 (alone) {two:.0f}; "
          f"epoch 2 / epoch 1 = {two / one:.2f} ({len(rates[1])} and {len(rates[2])} steps)")


if __name__ == "__main__":
    main()
