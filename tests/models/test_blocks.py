"""Anchors, block layout, labels, eval masks and the packed attention mask on hand-checkable tensors."""
import pytest
import torch

from dspark.models.block_draft import block_attention_mask
from dspark.training.blocks import anchor_candidates, build_blocks, sample_anchors


def test_anchor_candidates_need_loss_at_a_and_a_plus_1():
    lm = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0])
    assert anchor_candidates(lm).tolist() == [1, 4, 5]


def test_sample_anchors_sorted_distinct_and_padded():
    lm = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0])
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(lm, 5, g)
    assert keep.tolist() == [True, True, True, False, False]
    assert anchors[:3].tolist() == [1, 4, 5]
    for _ in range(20):  # fewer slots than candidates: sorted, distinct, valid
        a, k = sample_anchors(lm, 2, g)
        assert k.all() and a[0] < a[1] and set(a.tolist()) <= {1, 4, 5}
    with pytest.raises(ValueError):
        sample_anchors(lm, 0)


def test_sample_anchors_covers_all_candidates_uniformly():
    lm = torch.ones(12, dtype=torch.long)  # candidates 0..10
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(12)
    for _ in range(2000):
        a, _ = sample_anchors(lm, 3, g)
        counts[a] += 1
    assert counts[11] == 0
    frac = counts[:11] / counts[:11].sum()
    assert (frac - 1 / 11).abs().max() < 0.02


def test_build_blocks_anchor_layout_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]])
    anchors = torch.tensor([[2, 4]])
    keep = torch.tensor([[True, True]])
    b = build_blocks(ids, lm, anchors, keep, num_drafts=3, mask_token_id=99)
    assert b.input_ids.tolist() == [[[12, 99, 99], [14, 99, 99]]]
    assert b.positions.tolist() == [[[2, 3, 4], [4, 5, 6]]]
    # position a+k predicts token a+k+1
    assert b.labels.tolist() == [[[13, 14, 15], [15, 16, 17]]]
    # block 2: label 16 (pos 6) has loss_mask 0 -> prefix stops there even though pos 7 is 1
    assert b.eval_mask.tolist() == [[[True, True, True], [True, False, False]]]
    assert b.prev_ids.tolist() == [[[12, 13, 14], [14, 15, 16]]]
    assert b.teacher_positions.tolist() == [[[2, 3, 4], [4, 5, 6]]]
    assert b.pred_offset == 0


def test_build_blocks_end_of_sequence_and_padding_anchor():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    lm = torch.ones(1, 5, dtype=torch.long)
    b = build_blocks(ids, lm, torch.tensor([[3, 0]]), torch.tensor([[True, False]]), 3, 99)
    assert b.labels[0, 0].tolist() == [14, 0, 0]
    assert b.eval_mask[0, 0].tolist() == [True, False, False]
    assert not b.eval_mask[0, 1].any()


def test_build_blocks_mask_layout_matches_dflash():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    lm = torch.ones(1, 6, dtype=torch.long)
    b = build_blocks(ids, lm, torch.tensor([[1]]), torch.tensor([[True]]), 3, 99, layout="mask")
    assert b.input_ids.tolist() == [[[11, 99, 99, 99]]]
    assert b.positions.tolist() == [[[1, 2, 3, 4]]]
    assert b.labels.tolist() == [[[12, 13, 14]]]  # mask at position p predicts x_p
    assert b.pred_offset == 1
    with pytest.raises(ValueError):
        build_blocks(ids, lm, torch.tensor([[1]]), torch.tensor([[True]]), 3, 99, layout="bogus")


def naive_mask(anchors, L, S, W):
    B, A = anchors.shape
    m = torch.zeros(B, A * L, S + A * L, dtype=torch.bool)
    for b in range(B):
        for blk in range(A):
            a = int(anchors[b, blk])
            for q in range(blk * L, (blk + 1) * L):
                for j in range(S):
                    m[b, q, j] = j < a and (W is None or j >= a - W)
                for t in range(A * L):
                    m[b, q, S + t] = t // L == blk
    return m


@pytest.mark.parametrize("W", [None, 1, 3])
def test_block_mask_against_naive(W):
    anchors = torch.tensor([[0, 2, 5], [1, 4, 6]])
    got = block_attention_mask(anchors, 2, 8, W)
    assert torch.equal(got, naive_mask(anchors, 2, 8, W))


def test_block_mask_window_edges_by_hand():
    m = block_attention_mask(torch.tensor([[5]]), 2, 8, window=3)
    # context keys 2,3,4 (a-W .. a-1), never a itself or later; both block slots
    assert m[0, 0].tolist() == [False, False, True, True, True, False, False, False, True, True]
    assert torch.equal(m[0, 0], m[0, 1])
