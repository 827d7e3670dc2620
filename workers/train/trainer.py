"""The seam between the train task and a trainer: one rank's ``DrafterTrainer`` or a
data-parallel group's ``DataParallelTrainer`` (:mod:`workers.train.parallel`), which the task
drives alike through :class:`Trainer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from workers.train.drafter.features import TrainRow, plain_row  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from workers.train.drafter.microbatch import OutOfMemory
    from workers.train.drafter.model import DFlashDraftModel
    from workers.train.drafter.recipe import StepMetrics, TrainConfig
    from workers.train.drafter.schedule import Schedule


class Trainer(Protocol):
    """What the train task needs of a trainer, one rank or a group: :meth:`step` takes plain
    rows (the target's features computed per micro-batch) or rows with stored features."""

    @property
    def drafter(self) -> DFlashDraftModel: ...

    @property
    def steps(self) -> int: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def min_supervised(self) -> int: ...

    @property
    def config(self) -> TrainConfig: ...

    @property
    def oom(self) -> OutOfMemory:
        """The out-of-memory state: the budget in force, this step's retries."""

    def step(self, rows: Sequence[TrainRow]) -> StepMetrics: ...

    def eval_drafter(self) -> DFlashDraftModel:
        """A drafter rank 0 decodes with alone (a group's sharded one gathered first)."""

    def state_dict(self) -> dict[str, Any]: ...
