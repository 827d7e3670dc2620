"""An epoch's hours while a run trains: the plan's beside the measured steps', on the same steps.

    pace = EpochPace(plan)               # the rank's plan; None on the CPU: no planned hours
    pace.add(rows, metrics.seconds)      # after each step
    pace.steps_per_epoch = 1234          # the data's (workers.train.plan.epoch_steps)
    record.update(pace.fields())         # epoch_hours_planned, epoch_hours_measured (status)

Both are a mean per step over the same steps, times the epoch's steps. Planned: the FLOPs of the
rows each step trained, counted as ``plan-training`` counts an epoch
(:meth:`~common.plan.verdict.TrainingPlan.rows_flops`; no target forward for stored features),
at the plan's rate (the ranks' bf16 peak at its utilization). Measured: each step's own wall time
(the trainer's: the target's forward, the drafter's forward and backward, the optimizer), not the
time between steps, which in an online run also holds the waits for generation's shards, the
checkpoints and the evaluations. A process's first step (kernel compilation, the allocator's
warm-up) counts in neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.plan.compute import RowLength
from workers.train.drafter.features import FeaturedRow, TrainRow, plain_row

if TYPE_CHECKING:
    from common.plan.verdict import TrainingPlan

FIELDS = ("epoch_hours_planned", "epoch_hours_measured")


@dataclass
class EpochPace:
    """Planned and measured seconds of the steps trained in this process, and the epoch's steps."""

    plan: TrainingPlan | None
    steps_per_epoch: int = 0
    planned_s: float = 0.0
    measured_s: float = 0.0
    steps: int = 0
    warm: bool = False

    def add(self, rows: Sequence[TrainRow], seconds: float) -> None:
        """One step's rows and its wall seconds (the first step in the process is left out)."""
        if not self.warm:
            self.warm = True
            return
        self.steps += 1
        self.measured_s += seconds
        if self.plan is not None:
            stored = all(isinstance(r, FeaturedRow) for r in rows)
            lengths = [RowLength(len(plain_row(r).input_ids), plain_row(r).supervised_tokens)
                       for r in rows]
            flops = self.plan.rows_flops(lengths, with_target=not stored)
            self.planned_s += flops / self.plan.flops_per_s

    def hours(self) -> tuple[float | None, float | None]:
        """(planned, measured) hours of an epoch; None where not known yet (or no plan)."""
        if not self.steps or not self.steps_per_epoch:
            return None, None
        per_hour = self.steps_per_epoch / self.steps / 3600
        planned = self.planned_s * per_hour if self.plan is not None else None
        return planned, self.measured_s * per_hour

    def fields(self) -> dict[str, float | str]:
        """The metrics record's fields (Redis holds text: "" where unknown)."""
        return {name: "" if value is None else float(f"{value:.4g}")
                for name, value in zip(FIELDS, self.hours(), strict=True)}
