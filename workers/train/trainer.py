"""The seam between the train task and a trainer: one rank's ``DrafterTrainer`` or a
data-parallel group's ``DataParallelTrainer`` (:mod:`workers.train.parallel`), which the task
drives alike through :class:`Trainer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from common.runs.trainrows import TrainingRow

if TYPE_CHECKING:
    from workers.train.drafter.features import FeaturedRow
    from workers.train.drafter.model import DFlashDraftModel
    from workers.train.drafter.schedule import Schedule
    from workers.train.drafter.train import StepMetrics

    TrainRow = TrainingRow | FeaturedRow
else:
    TrainRow = Any


def plain_row(row: TrainRow) -> TrainingRow:
    """The training row itself, with or without the target features computed for it."""
    return row if isinstance(row, TrainingRow) else row.row


class Trainer(Protocol):
    """What the train task needs of a trainer, one rank or a group."""

    # True: :meth:`step` takes plain rows, its ranks compute the target's features themselves;
    # False: the task computes them (or reads them from storage) before each step.
    featurizes: bool

    @property
    def drafter(self) -> DFlashDraftModel: ...

    @property
    def steps(self) -> int: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def min_supervised(self) -> int: ...

    def step(self, rows: Sequence[TrainRow]) -> StepMetrics: ...

    def state_dict(self) -> dict[str, Any]: ...
