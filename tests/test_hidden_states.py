"""Hidden-state extraction against a direct HF forward, length batching, checks and the store."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from common import keys
from common.errors import HiddenStateError
from common.hidden.store import (
    check_record,
    committed_hidden_shards,
    decode_part,
    iter_hidden_records,
    read_hidden_commit,
    read_hidden_index,
    write_hidden_commit,
)
from common.hidden.writer import HiddenShardWriter
from common.runs.trainrows import TrainingRow
from common.storage import LocalStorage
from tests.conftest import TinyTarget
from tests.tolerance import assert_close
from workers.batching import length_batches
from workers.hidden.extraction import ExtractorConfig, HiddenExtractor, check_finite

LENGTHS = [5, 40, 17, 33, 1, 26]


@pytest.fixture(scope="module")
def tiny_path(target_model: TinyTarget) -> Path:
    """Each embedded target: dense tiny-qwen3 and hybrid tiny-qwen3.5."""
    return target_model.path


@pytest.fixture(scope="module", params=["dflash", "eagle3"])
def extractor(request: pytest.FixtureRequest, tiny_path: Path) -> HiddenExtractor:
    return HiddenExtractor(ExtractorConfig(str(tiny_path), layout=request.param, device="cpu"))


def make_rows(vocab: int, lengths: list[int], seed: int = 0) -> list[TrainingRow]:
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        prompt = n // 2
        rows.append(TrainingRow(f"s{i}", i % 2, [rng.randrange(vocab) for _ in range(n)],
                                [0] * prompt + [1] * (n - prompt)))
    return rows


def test_extract_matches_single_row_forward(extractor: HiddenExtractor) -> None:
    rows = make_rows(extractor.vocab_size, LENGTHS)
    records = extractor.extract(rows)
    assert extractor.dtype == torch.float32
    assert [(r.sample_id, r.turn) for r in records] == [(r.sample_id, r.turn) for r in rows]
    width = len(extractor.layer_ids) * extractor.hidden_size
    for row, record in zip(rows, records, strict=True):
        with torch.inference_mode():
            out = extractor.model(torch.tensor([row.input_ids]), output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1][0] for i in extractor.layer_ids], dim=-1)
        assert record.hidden_states.shape == (len(row.input_ids), width)
        assert_close(record.hidden_states, expected, rel=1e-5, what="hidden states")
        assert record.input_ids.dtype == torch.int32 and record.loss_mask.dtype == torch.uint8
        assert record.input_ids.tolist() == row.input_ids
        assert record.loss_mask.tolist() == row.loss_mask
        if extractor.config.layout == "eagle3":
            assert_close(record.last_hidden_states, out.hidden_states[-1][0], rel=1e-5,
                         what="last hidden states")
        else:
            assert record.last_hidden_states is None


def test_layer_choice_follows_layout(extractor: HiddenExtractor) -> None:
    assert extractor.num_layers == 8 and extractor.hidden_size == 128
    expected = [1, 2, 3, 4, 5] if extractor.config.layout == "dflash" else [1, 3, 4]
    assert extractor.layer_ids == expected == list(extractor.meta.layer_ids)


def test_out_of_range_token_ids_are_refused(extractor: HiddenExtractor) -> None:
    bad = TrainingRow("bad", 0, [1, 2, extractor.vocab_size], [0, 1, 1])
    with pytest.raises(HiddenStateError, match="out of range"):
        extractor.extract([bad])
    with pytest.raises(HiddenStateError, match="loss-mask"):
        extractor.extract([TrainingRow("short", 0, [1, 2, 3], [0, 1])])


def lognormal_rows(count: int, seed: int) -> list[TrainingRow]:
    rng = random.Random(seed)
    lengths = [max(16, min(8192, int(rng.lognormvariate(6.5, 0.8)))) for _ in range(count)]
    return [TrainingRow(f"r{i}", 0, [1] * n, [1] * n) for i, n in enumerate(lengths)]


def test_length_batching_keeps_padding_low() -> None:
    rows = lognormal_rows(200, seed=3)
    batches, stats = length_batches(rows, max_tokens=16384, max_rows=32)
    _, plain = length_batches(rows, max_tokens=16384, max_rows=32, sort=False, max_waste=None)
    assert stats.real_tokens == plain.real_tokens == sum(len(r.input_ids) for r in rows)
    assert stats.waste <= 0.05, stats
    assert plain.waste >= 0.3, plain
    assert stats.batches <= 1.25 * plain.batches  # low padding without shrinking the batches
    flat = [(r.sample_id, r.turn) for b in batches for r in b]
    assert sorted(flat) == sorted((r.sample_id, r.turn) for r in rows)
    for batch in batches:
        width = max(len(r.input_ids) for r in batch)
        assert len(batch) <= 32 and (width * len(batch) <= 16384 or len(batch) == 1)
    padded = sum(len(b) * max(len(r.input_ids) for r in b) for b in batches) - stats.real_tokens
    assert padded == stats.padded_tokens


def test_nan_check_fires_on_corrupted_tensor(extractor: HiddenExtractor) -> None:
    rows = make_rows(extractor.vocab_size, [4, 6])
    features = torch.randn(2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    features[0, 5, 3] = float("nan")  # padding position of row 0: ignored
    check_finite(features, mask, rows)
    features[1, 2, 0] = float("inf")
    with pytest.raises(HiddenStateError, match="s1#1"):
        check_finite(features, mask, rows)
    record = extractor.extract(rows[:1])[0]
    check_record(record, extractor.meta)
    corrupted = record.hidden_states.clone()
    corrupted[2, 7] = float("nan")
    bad = dataclasses.replace(record, hidden_states=corrupted)
    with pytest.raises(HiddenStateError, match="NaN"):
        check_record(bad, extractor.meta)


def test_store_round_trip_and_put_once(extractor: HiddenExtractor, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    rows = make_rows(extractor.vocab_size, [12, 30, 7, 22, 18, 9, 25], seed=1)
    batches, _ = length_batches(rows, max_tokens=64, max_rows=4)
    writer = HiddenShardWriter(storage, "r1", 3, extractor.meta, part_bytes=20 * 2**10)
    records = []
    for batch in batches:
        records += extractor.extract(batch)
        writer.add(records[-len(batch):])
    writer.add(records[:1])  # a duplicate is dropped, not stored twice
    index = writer.finish()
    assert 1 < len(index.parts) < len(records)  # many records per file, several files
    assert index.records == len(records) and index.dtype == "bf16"
    assert index.tokens == sum(len(r.input_ids) for r in rows)
    assert json.loads(storage.get(keys.hidden_index("r1", 3)))["layer_ids"] == extractor.layer_ids

    assert list(iter_hidden_records(storage, "r1")) == []  # not committed yet
    commit = write_hidden_commit(storage, "r1", 3, index, worker="w1")
    assert committed_hidden_shards(storage, "r1") == [3]
    got = list(iter_hidden_records(storage, "r1"))
    assert [(g["sample_id"], g["turn"]) for g in got] == [
        (s, t) for p in index.parts for s, t in zip(p.sample_ids, p.turns, strict=True)]
    by_id = {(r.sample_id, r.turn): r for r in records}
    for item in got:
        want = by_id[(item["sample_id"], item["turn"])]
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], want.hidden_states.to(torch.bfloat16))
        assert torch.equal(item["input_ids"], want.input_ids)
        assert torch.equal(item["loss_mask"], want.loss_mask)
        if extractor.meta.has_last:
            assert torch.equal(item["last_hidden_states"],
                               want.last_hidden_states.to(torch.bfloat16))
        else:
            assert "last_hidden_states" not in item

    # A redelivered attempt never overwrites: parts go after the existing ones, the first
    # index and the first commit stand.
    first_part = storage.get(index.parts[0].key)
    assert storage.put_once(index.parts[0].key, b"other bytes") is False
    assert storage.get(index.parts[0].key) == first_part
    again = HiddenShardWriter(storage, "r1", 3, extractor.meta)
    again.add(records[:2])
    second = again.finish()
    assert again.parts[0].key == keys.hidden_part("r1", 3, len(index.parts))
    assert second == index == read_hidden_index(storage, "r1", 3)
    assert write_hidden_commit(storage, "r1", 3, again.finish()) == commit
    assert read_hidden_commit(storage, "r1", 3) == index
    assert len(list(iter_hidden_records(storage, "r1", shards=[3, 4]))) == len(records)

    tensors, metadata = decode_part(first_part)
    assert json.loads(metadata["sample_ids"]) == index.parts[0].sample_ids
    assert tensors["offsets"][-1].item() == tensors["input_ids"].shape[0]
