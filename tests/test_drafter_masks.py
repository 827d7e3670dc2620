"""DFlash attention pattern, anchors, labels and slot weights on small hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common.runs.trainrows import TrainingRow
from tests.tolerance import assert_close
from workers.train.drafter.blocks import (
    IGNORE,
    acceptance_length,
    anchor_candidates,
    block_labels,
    pack_rows,
    sample_anchors,
    slot_weights,
)
from workers.train.drafter.masks import dense_block_mask, flex_block_mask


def rows_of(*lines: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in line.replace(" ", "")] for line in lines])


def test_dense_mask_two_blocks_one_sequence() -> None:
    # seq len 10, B=4, anchors at 2 and 6; key columns: context 0..9 | block 0 | block 1
    mask = dense_block_mask(torch.tensor([2, 6]), torch.tensor([0, 0]), 10, 4)
    block0 = "1100000000 1111 0000"   # context strictly before 2, its own block only
    block1 = "1111110000 0000 1111"   # context strictly before 6, its own block only
    expected = rows_of(*[block0] * 4, *[block1] * 4)
    assert mask.shape == (8, 18)
    assert torch.equal(mask, expected)


def test_dense_mask_packed_rows_see_only_their_own_context() -> None:
    # two rows of 5 tokens packed as context 0..9; anchors at row positions 3 and 2
    mask = dense_block_mask(torch.tensor([3, 7]), torch.tensor([0, 5]), 10, 2)
    block0 = "1110000000 11 00"
    block1 = "0000011000 00 11"   # row 2 starts at 5: nothing of row 1 is visible
    assert torch.equal(mask, rows_of(block0, block0, block1, block1))


def test_anchor_at_row_start_sees_only_its_block() -> None:
    mask = dense_block_mask(torch.tensor([0]), torch.tensor([0]), 3, 2)
    assert torch.equal(mask, rows_of("000 11", "000 11"))


def test_block_labels_slot_zero_excluded_and_out_of_range_ignored() -> None:
    ids = torch.arange(10, 20)
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    labels, valid = block_labels(ids, loss_mask, torch.tensor([3, 7]), 4)
    assert labels.tolist() == [[IGNORE, 14, 15, 16], [IGNORE, 18, 19, IGNORE]]
    assert valid.tolist() == [[False, True, True, True], [False, True, True, False]]


def test_block_labels_skip_unsupervised_positions() -> None:
    ids = torch.arange(10, 20)
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1, 1])
    labels, _ = block_labels(ids, loss_mask, torch.tensor([3]), 4)
    assert labels.tolist() == [[IGNORE, 14, IGNORE, 16]]


def test_slot_weights_decay_from_slot_one() -> None:
    weights = slot_weights(16, 7.0)
    assert weights[0] == 0.0
    assert weights[1] == pytest.approx(1.0)
    for k in range(1, 16):
        assert weights[k].item() == pytest.approx(math.exp(-(k - 1) / 7.0))


def test_anchor_candidates_need_the_next_token_supervised() -> None:
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    assert anchor_candidates(loss_mask).tolist() == [2, 3, 6]


def test_sample_anchors_seeded_distinct_sorted_and_capped() -> None:
    loss_mask = torch.tensor([0] * 5 + [1] * 100)
    first = sample_anchors(loss_mask, 16, torch.Generator().manual_seed(3))
    again = sample_anchors(loss_mask, 16, torch.Generator().manual_seed(3))
    other = sample_anchors(loss_mask, 16, torch.Generator().manual_seed(4))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.numel() == 16 and len(set(first.tolist())) == 16
    assert first.tolist() == sorted(first.tolist())
    assert all(5 <= a < 104 for a in first.tolist())
    assert sample_anchors(loss_mask, 512, torch.Generator()).numel() == 99


def test_pack_rows_layout() -> None:
    rows = [TrainingRow("a", 0, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),
            TrainingRow("b", 0, [6, 7, 8, 9], [0, 1, 1, 1])]
    feats = [torch.zeros(5, 6), torch.ones(4, 6)]
    batch = pack_rows(rows, feats, [torch.tensor([2, 3]), torch.tensor([1])], 3, 99)
    assert batch.tokens == 9 and batch.blocks == 3 and batch.rows == 2
    assert batch.context_positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert batch.anchors.tolist() == [2, 3, 6] and batch.starts.tolist() == [0, 0, 5]
    assert batch.block_ids.tolist() == [3, 99, 99, 4, 99, 99, 7, 99, 99]
    assert batch.block_positions.tolist() == [2, 3, 4, 3, 4, 5, 1, 2, 3]
    assert batch.labels.tolist() == [[IGNORE, 4, 5], [IGNORE, 5, IGNORE], [IGNORE, 8, 9]]
    assert batch.features.shape == (9, 6) and batch.features[5:].eq(1).all()


def test_acceptance_length_from_slot_accuracy() -> None:
    assert acceptance_length([1.0, 1.0, 0.0, 1.0]) == pytest.approx(3.0)
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert acceptance_length([float("nan"), 1.0]) == pytest.approx(1.0)


def flex_runs_on_cpu() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not flex_runs_on_cpu(), reason="this torch has no flex_attention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_mask_matches_dense_mask() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    anchors, starts = torch.tensor([1, 4, 9, 15, 17]), torch.tensor([0, 0, 6, 12, 12])
    context, block, heads, kv_heads, dim = 20, 4, 4, 2, 8
    q = torch.randn(1, heads, anchors.numel() * block, dim)
    k = torch.randn(1, kv_heads, context + anchors.numel() * block, dim)
    v = torch.randn_like(k)
    dense = dense_block_mask(anchors, starts, context, block)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    block_mask = flex_block_mask(anchors, starts, context, block, "cpu")
    got = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert_close(got, expected, rel=1e-5)
