"""The learning-rate schedule the defaults give at the seed's size, beside the one-pass fixed
schedule it replaced: steps, epochs, the learning rate at 25/50/75/100% of training, and how
many steps run at learning rate 0.

    .venv/bin/python benchmarks/epoch_schedule.py [--samples 902087] [--accepted 0.975]

The data schedule is the product's own (:func:`workers.train.plan.planned_total` over a
manifest of the seed's shards, then :class:`Schedule`), first as the trainer estimates it before
any shard is trained (the held-out share only), then exact at the given acceptance rate (the
seed's gates kept ~880K of 902,087 samples). No model, no GPU: seconds.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli.options import RunOptions  # noqa: E402
from common.config import TrainSettings  # noqa: E402
from common.runs.checkpoints import Ledger  # noqa: E402
from common.runs.records import RunConfig  # noqa: E402
from workers.train.drafter.schedule import Schedule  # noqa: E402
from workers.train.drafter.train import TrainConfig  # noqa: E402
from workers.train.epochs import note_shard  # noqa: E402
from workers.train.plan import planned_total  # noqa: E402

OLD_TOTAL_STEPS = 2000   # the fixed --total-steps default this schedule replaced


def shard_rows(samples: int, shard_size: int) -> list[int]:
    full, rest = divmod(samples, shard_size)
    return [shard_size] * full + ([rest] if rest else [])


def factors_at(schedule: Schedule, steps: int) -> list[float]:
    """The learning-rate factor at 25/50/75/100% of ``steps`` (100%: the last step run)."""
    return [schedule.factor(max(0, math.ceil(steps * q) - 1)) for q in (0.25, 0.5, 0.75, 1.0)]


def describe(name: str, schedule: Schedule, steps_run: int, epochs: int, lr: float) -> str:
    at_zero = sum(schedule.factor(s) == 0.0 for s in range(steps_run))
    lrs = "  ".join(f"{lr * f:.2e}" for f in factors_at(schedule, steps_run))
    return (f"{name:<40} {epochs:>6} {steps_run:>10,} {schedule.total:>10,} {lrs}   "
            f"{at_zero:>9,} ({at_zero / steps_run:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=902_087)
    parser.add_argument("--accepted", type=float, default=0.975,
                        help="Share of samples the gates accept (the seed's: ~880K of 902K).")
    args = parser.parse_args()
    rows_per_step = TrainSettings().rows_per_step
    config = RunConfig(run="seed", model="m", input="x", format="auto", prompt_field=None,
                       shard_size=RunOptions.shard_size, limit=None)
    rows = shard_rows(args.samples, config.shard_size)
    lr = TrainConfig(total_steps=1).lr
    estimated, basis = planned_total(Ledger(), config, rows, rows_per_step)
    ledger = Ledger()
    keep = args.accepted * (1 - config.heldout_fraction)
    for shard, n in enumerate(rows):
        note_shard(ledger, shard, round(n * keep), rows_per_step)
    exact, exact_basis = planned_total(ledger, config, rows, rows_per_step)
    warmup = TrainConfig(total_steps=estimated).warmup_steps
    data = Schedule(warmup, estimated)
    data.revise(exact, steps_run := exact // 4)   # revised a quarter in, as shards get known
    one_pass = exact // config.epochs
    old = Schedule(TrainConfig(total_steps=OLD_TOTAL_STEPS).warmup_steps, OLD_TOTAL_STEPS)
    print(f"seed: {args.samples:,} samples in {len(rows):,} shards of {config.shard_size}; "
          f"{rows_per_step} rows/step; peak lr {lr:.0e}, warmup {warmup:,} steps (4%)")
    print(f"first estimate: {basis}\nexact:          {exact_basis}")
    print(f"\n{'schedule':<40} {'epochs':>6} {'steps run':>10} {'total':>10} "
          f"{'lr@25%':>8}  {'lr@50%':>8}  {'lr@75%':>8}  {'lr@100%':>8}   steps at lr 0")
    print(describe("before: fixed 2000, one pass", old, one_pass, 1, lr))
    print(describe(f"now: from the data (revised at {steps_run:,})", data, exact,
                   config.epochs, lr))
    print(f"\nsteps per epoch {one_pass:,}: before, {OLD_TOTAL_STEPS:,} of one pass learned "
          f"({OLD_TOTAL_STEPS / one_pass:.1%}); now every step of {config.epochs} epochs does")


if __name__ == "__main__":
    main()
