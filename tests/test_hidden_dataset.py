"""Stored hidden states as a PyTorch IterableDataset: every record once per epoch, any readers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from common.hidden.dataset import HiddenStatesDataset
from common.hidden.store import HiddenMeta, HiddenRecord, write_hidden_commit
from common.hidden.writer import HiddenShardWriter
from common.storage import LocalStorage

META = HiddenMeta(layout="dflash", layer_ids=(1, 2), hidden_size=4, num_layers=4)


def stored_run(root: Path, shards: int = 5, per_shard: int = 3) -> set[tuple[str, int]]:
    """``shards`` committed hidden-state shards of ``per_shard`` records, written for real."""
    storage = LocalStorage(root)
    ids = set()
    for shard in range(shards):
        writer = HiddenShardWriter(storage, "r", shard, META, part_bytes=200)
        for k in range(per_shard):
            length = 3 + k
            writer.add([HiddenRecord(f"s{shard}-{k}", 0, torch.arange(length, dtype=torch.int32),
                                     torch.ones(length, dtype=torch.uint8),
                                     torch.full((length, META.width), float(shard),
                                                dtype=torch.bfloat16))])
            ids.add((f"s{shard}-{k}", 0))
        write_hidden_commit(storage, "r", shard, writer.finish(), worker="test")
    return ids


def read_all(dataset: HiddenStatesDataset, workers: int) -> list[tuple[str, int]]:
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return [(record["sample_id"], int(record["turn"])) for record in loader]


def test_two_dataloader_workers_yield_every_record_once_per_epoch(tmp_path: Path) -> None:
    ids = stored_run(tmp_path)
    dataset = HiddenStatesDataset(str(tmp_path), "r")
    for epoch in range(2):
        dataset.set_epoch(epoch)
        got = read_all(dataset, workers=2)
        assert Counter(got) == Counter(ids) and len(got) == len(ids)
    record = next(iter(dataset))
    assert record["hidden_states"].shape == (3, META.width)
    assert record["loss_mask"].dtype == torch.uint8


def test_shuffle_and_ranks_still_cover_everything_once(tmp_path: Path) -> None:
    ids = stored_run(tmp_path)
    orders = []
    for epoch in (0, 1):
        shuffled = HiddenStatesDataset(str(tmp_path), "r", shuffle_buffer=4, seed=7)
        shuffled.set_epoch(epoch)
        orders.append(read_all(shuffled, workers=2))
        assert sorted(orders[-1]) == sorted(ids)
    assert orders[0] != orders[1], "the epoch does not change the order"
    ranks = [read_all(HiddenStatesDataset(str(tmp_path), "r", rank=r, world_size=2), workers=2)
             for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1]) and set(ranks[0]) | set(ranks[1]) == ids
