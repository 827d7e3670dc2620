"""A run's stored hidden states as a ``torch.utils.data.IterableDataset``, for any trainer.

    from common.hidden.dataset import HiddenStatesDataset
    data = HiddenStatesDataset("s3://bucket/prefix", "my-run", shuffle_buffer=1024, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=4)
    for epoch in range(3):
        data.set_epoch(epoch)
        for record in loader:  # input_ids, loss_mask, hidden_states[T, K*H], sample_id, turn
            ...

Committed shards are split across distributed ranks (``torch.distributed`` when initialised,
or ``rank``/``world_size``) and then across ``DataLoader`` workers, so every record is yielded
exactly once per epoch. ``shuffle_buffer`` > 0 shuffles within a buffer of that many records,
reproducibly from ``seed`` and the epoch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.hidden.store import committed_hidden_shards, iter_hidden_records
from common.storage import Storage, open_storage


class HiddenStatesDataset(IterableDataset[Any]):
    """Every committed hidden-state record of a run, each once per epoch over all readers."""

    def __init__(self, storage: Storage | str, run: str, *, shuffle_buffer: int = 0,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        self.storage = storage if isinstance(storage, Storage) else None
        self.url = storage if isinstance(storage, str) else None
        self.run, self.shuffle_buffer, self.seed = run, shuffle_buffer, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """A different (reproducible) order each epoch when shuffling."""
        self.epoch = epoch

    def _storage(self) -> Storage:
        # Opened in each DataLoader worker: boto3 clients must not cross processes.
        if self.storage is None:
            if self.url is None:   # given a Storage, the dataset keeps it
                raise ValueError("a dataset without storage has a URL to open")
            self.storage = open_storage(self.url)
        return self.storage

    def _reader(self) -> tuple[int, int]:
        """This reader's index among all ranks x workers, and their number."""
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if initialised else 0
            world = torch.distributed.get_world_size() if initialised else 1
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return rank * workers + worker, world * workers

    def shards(self) -> list[int]:
        """The committed shards this reader yields."""
        index, readers = self._reader()
        return committed_hidden_shards(self._storage(), self.run)[index::readers]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        records = iter_hidden_records(self._storage(), self.run, self.shards())
        if self.shuffle_buffer <= 0:
            yield from records
            return
        index, _ = self._reader()
        rng = random.Random(hash((self.seed, self.epoch, index)))
        buffer: list[dict[str, Any]] = []
        for record in records:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(record)
                continue
            slot = rng.randrange(len(buffer))
            yield buffer[slot]
            buffer[slot] = record
        rng.shuffle(buffer)
        yield from buffer
