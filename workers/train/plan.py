"""The learning-rate schedule's length from the run's data: epochs x the steps a shard makes
(exact once trained, estimated from the manifest before)."""

from __future__ import annotations

import math

from common.runs.checkpoints import Ledger
from common.runs.records import RunConfig


def planned_total(ledger: Ledger, config: RunConfig, shard_rows: list[int],
                  rows_per_step: int) -> tuple[int, str]:
    """The schedule's length from the data, and its basis in words."""
    per_epoch, basis = epoch_steps(ledger, config, shard_rows, rows_per_step)
    return config.epochs * per_epoch, f"{config.epochs} epoch(s) x {basis}"


def epoch_steps(ledger: Ledger, config: RunConfig, shard_rows: list[int],
                rows_per_step: int) -> tuple[int, str]:
    """Steps an epoch of the data makes (exact for trained shards, estimated for the rest),
    and its basis in words."""
    known = {int(s) for s in ledger.shard_steps}
    exact = sum(ledger.shard_steps.values())
    unknown = [s for s in range(len(shard_rows)) if s not in known]
    inputs_known = sum(shard_rows[s] for s in known if s < len(shard_rows))
    if known and inputs_known:
        rate = sum(ledger.shard_rows.values()) / inputs_known
        how = f"{rate:.3f} training rows per input row seen on {len(known)} shard(s)"
    else:
        rate = 1.0 - config.heldout_fraction
        how = f"{rate:.3f} rows per input row (held-out share only; nothing trained yet)"
    estimated = sum(math.ceil(shard_rows[s] * rate / rows_per_step) for s in unknown)
    per_epoch = max(1, exact + estimated)
    basis = (f"{per_epoch} steps/epoch at {rows_per_step} rows/step: "
             + (f"exact, all {len(known)} shards trained once" if not unknown else
                f"{exact} exact from {len(known)} trained shard(s), {estimated} estimated for "
                f"{len(unknown)} more at {how}"))
    return per_epoch, basis
