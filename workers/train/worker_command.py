"""``dflash-pipeline worker train``: a Celery worker on queue ``train``, a group of ranks."""

from __future__ import annotations

from workers.train.group import TRAIN_LAUNCH
from workers.worker_cli import stage_worker

worker_train = stage_worker(
    TRAIN_LAUNCH, "Run a Celery worker on queue `train`: online DFlash drafter training (one per "
             "run).")
