"""Training metrics to TensorBoard, the convention drafter trainers use (off by default).

``dflash-pipeline worker train --tensorboard-dir DIR`` (``DFLASH_TENSORBOARD_DIR``): every
step's record (loss, per-slot accuracies, acceptance length, tokens/s, the learning rate, tau
when present) goes to ``DIR/<run>/``, and each epoch's held-out tau to ``epoch/tau`` (x: the
epoch); view it with ``tensorboard --logdir DIR``. A worker that resumed from a
checkpoint purges the steps after it, so a crash's extra steps do not draw twice.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SKIPPED = {"step", "at", "tau_by_epoch"}

_boards: dict[tuple[str, str], TrainBoard] = {}
_lock = threading.Lock()


class TrainBoard:
    """One run's TensorBoard writer; scalars under ``train/`` and ``slot_accuracy/``."""

    def __init__(self, directory: str, run: str, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(directory) / run
        self.writer = SummaryWriter(log_dir=str(self.path), purge_step=first_step)
        self.epochs_logged = 0

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's metrics record (as train_step builds it) and flush."""
        step = int(record["step"])
        for name, value in record.items():
            if name == "slot_accuracy":
                slots = json.loads(value) if isinstance(value, str) else value
                for k, accuracy in enumerate(slots, start=1):
                    if accuracy is not None:   # null: the slot had no label this step
                        self.writer.add_scalar(f"slot_accuracy/slot{k}", float(accuracy), step)
            elif name not in SKIPPED and isinstance(value, int | float):
                self.writer.add_scalar(f"train/{name}", float(value), step)
        self.log_epochs(record.get("tau_by_epoch"))
        self.writer.flush()

    def log_epochs(self, taus: Any) -> None:
        """Each epoch's held-out tau once, at x = the epoch (1-based)."""
        taus = json.loads(taus) if isinstance(taus, str) else taus or []
        for epoch in range(self.epochs_logged, len(taus)):
            if taus[epoch] is not None:
                self.writer.add_scalar("epoch/tau", float(taus[epoch]), epoch + 1)
        self.epochs_logged = max(self.epochs_logged, len(taus))

    def close(self) -> None:
        self.writer.close()


def log_step(directory: str, run: str, record: dict[str, Any]) -> None:
    """Write ``record`` to the run's board when ``directory`` is set (the worker's setting)."""
    if not directory:
        return
    with _lock:
        board = _boards.get((directory, run))
        if board is None:
            board = _boards[(directory, run)] = TrainBoard(directory, run, int(record["step"]))
            log.info("run %s: TensorBoard events in %s", run, board.path)
    board.log(record)
