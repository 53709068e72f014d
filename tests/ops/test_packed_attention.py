"""The packed-blocks attention (dspark.ops.attention.PackedBlockMask: the block rule without the dense mask) against
the dense-mask reference: the mask it applies, read back by hand; values and gradients; the flex backend; the
training module's losses. A wrong rule must fail these checks (test_a_wrong_rule_is_caught).

Tolerance: both paths compute in float32 from the same inputs, but the packed one scores fewer keys in other
shapes (masked keys are exact zeros in the dense path), so matmul and softmax sums are reduced in another order.
Each output is a convex combination of at most ~40 values of size ~3, a float32 reduction of length L errs by
about L * 2^-24 relative: a few 1e-6 here, so 1e-5 (conftest.FP32_CROSS_SHAPE_ATOL) separates rounding from a
wrong key, whose weight is >= 1/40 and moves an output by ~1e-2.
"""
from __future__ import annotations

import pytest
import torch
from conftest import FP32_CROSS_SHAPE_ATOL as TOL
from test_blocks import naive_mask

from dspark.models.block_draft import block_attention_mask, packed_block_attention_mask
from dspark.ops.attention import PackedBlockMask, masked_attention

# anchors with the edges: anchor 0 (no context: also the padding slots training adds), anchor 1, anchors closer
# together than the window, the last context position, a window reaching before position 0
ANCHORS = torch.tensor([[0, 1, 5, 6, 11], [3, 9, 10, 0, 0]])  # row 1: two padding slots (anchor 0)
S, K = 12, 3


def _seen_keys(mask, hq=2, hk=1):
    """Reads the mask back from the attention itself: q = 0 gives uniform weights over the visible keys, and v[j] =
    one-hot(j) makes output[t, j] = 1 / (visible keys of t) exactly where t sees j."""
    b, t, length = mask.shape
    q = torch.zeros(b, hq, t, 4)
    k = torch.randn(b, hk, length, 4)
    v = torch.eye(length).expand(b, hk, length, length)
    out = masked_attention(q, k, v, mask, scale=1.0, query_chunk=4)  # [B, Hq, T, L]
    assert torch.equal(out[:, 0], out[:, 1])
    return out[:, 0] > 0


@pytest.mark.parametrize("window", [None, 1, 2, 4, 50])
def test_packed_mask_by_hand(window):
    """The keys each query attends to through the packed path are exactly the block rule's (test_blocks' naive
    loop), window edges, anchor 0 and padding slots included; dense() is block_attention_mask."""
    pm = packed_block_attention_mask(ANCHORS, K, S, window)
    want = naive_mask(ANCHORS, K, S, window)
    assert tuple(pm.shape) == tuple(want.shape) and pm.dtype == torch.bool
    assert torch.equal(pm.dense(), block_attention_mask(ANCHORS, K, S, window))
    assert torch.equal(_seen_keys(pm), want)
    assert torch.equal(_seen_keys(block_attention_mask(ANCHORS, K, S, window)), want)


def test_window_edge_by_hand():
    # block at anchor 6, window 4: context keys 2..5 (a-W .. a-1), never 6 itself; its block slots S+9..S+11
    seen = _seen_keys(PackedBlockMask(ANCHORS, K, S, 4))
    row = seen[0, 3 * K]  # first query of block 3 (anchor 6)
    assert row.nonzero().flatten().tolist() == [2, 3, 4, 5, S + 9, S + 10, S + 11]
    row = seen[1, 3 * K + 1]  # a padding slot (anchor 0): its own block only
    assert row.nonzero().flatten().tolist() == [S + 9, S + 10, S + 11]


def _qkv(hq, hk, t, length, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_(True)  # noqa: E731
    return mk(2, hq, t, d), mk(2, hk, length, d), mk(2, hk, length, d), mk(hq)


@pytest.mark.parametrize("window", [None, 2, 4, 50])
@pytest.mark.parametrize("query_chunk", [1, 6, 256])  # 1 block per group (gathered windows) .. all in one group
@pytest.mark.parametrize("hq,hk,with_sink", [(4, 2, True), (4, 1, False), (2, 2, True)])
def test_packed_equals_dense_values_and_gradients(window, query_chunk, hq, hk, with_sink):
    pm = PackedBlockMask(ANCHORS, K, S, window)
    _, t, length = pm.shape
    q, k, v, sink = _qkv(hq, hk, t, length)
    sink = sink if with_sink else None
    ref = masked_attention(q, k, v, pm.dense(), 0.35, sink)
    got = masked_attention(q, k, v, pm, 0.35, sink, query_chunk=query_chunk)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)
    inputs = [q, k, v] + ([sink] if with_sink else [])
    g_ref = torch.autograd.grad((ref * ref.detach().sin()).sum(), inputs)
    g_got = torch.autograd.grad((got * ref.detach().sin()).sum(), inputs)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_a_wrong_rule_is_caught(monkeypatch):
    """The comparison above fails for a rule off by one key: a block that also sees its anchor's own position."""
    pm = PackedBlockMask(ANCHORS, K, S, 4)
    _, t, length = pm.shape
    q, k, v, sink = _qkv(4, 2, t, length)
    ref = masked_attention(q, k, v, pm.dense(), 0.35, sink)
    right = PackedBlockMask.context_bounds

    def off_by_one(self):
        lo, hi = right(self)
        return lo, (hi + 1).clamp(max=self.context_len)

    monkeypatch.setattr(PackedBlockMask, "context_bounds", off_by_one)
    got = masked_attention(q, k, v, pm, 0.35, sink)
    assert (got - ref).abs().max() > 100 * TOL
    assert not torch.equal(_seen_keys(pm), naive_mask(ANCHORS, K, S, 4))


@pytest.mark.parametrize("window,rule", [(None, "block"), (4, "block"), (4, "query"), (3, "query")])
def test_flex_takes_the_rule(window, rule):
    """The CUDA backend (flex_attention, eager on CPU) with the rule as its mask_mod gives the reference's numbers,
    under both window rules (DeepSeek-V4's per-block one and vLLM's per-query one)."""
    pm = PackedBlockMask(ANCHORS, K, S, window, rule)
    _, t, length = pm.shape
    q, k, v, sink = (x.detach() for x in _qkv(4, 2, t, length))
    ref = masked_attention(q, k, v, pm.dense(), 0.35, sink, backend="reference")
    flex = masked_attention(q, k, v, pm, 0.35, sink, backend="flex")
    torch.testing.assert_close(flex, ref, atol=TOL, rtol=TOL)


def test_bad_packed_masks_raise():
    with pytest.raises(ValueError, match="window"):
        PackedBlockMask(ANCHORS, K, S, 0)
    with pytest.raises(ValueError, match="anchors"):
        PackedBlockMask(ANCHORS[0], K, S, None)
    pm = PackedBlockMask(ANCHORS, K, S, None)
    q, k, v, _ = _qkv(2, 2, 14, S + 14)
    with pytest.raises(ValueError, match="whole blocks"):
        masked_attention(q, k, v, pm, 1.0)


@pytest.mark.parametrize("kind", ["v4", "dense"])
def test_module_losses_equal_with_the_dense_mask(kind):
    """The training forward (DSV4 draft: window + sink; dense draft: full context) gives the same losses and
    gradients with the packed rule as with the dense mask."""
    from test_fused_loss import _batch, _module

    dense_m, packed_m = _module(kind, "vanilla", True), _module(kind, "vanilla", True)
    packed_m.draft.load_state_dict(dense_m.draft.state_dict())
    dense_m.packed_attention_mask = False
    ref, _ = dense_m._losses(_batch())
    got, _ = packed_m._losses(_batch())
    for key in ref:
        torch.testing.assert_close(got[key].detach(), ref[key].detach(), atol=TOL, rtol=TOL, msg=key)
    ref["loss"].backward()
    got["loss"].backward()
    grads = dict(dense_m.draft.named_parameters())
    for name, p in packed_m.draft.named_parameters():
        if grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, atol=TOL, rtol=1e-4, msg=name)


def test_recomputed_groups_give_the_same_gradients(monkeypatch):
    """Long contexts recompute each block group's scores in the backward (RECOMPUTE_BYTES): same numbers."""
    import dspark.ops.attention as attention

    monkeypatch.setattr(attention, "RECOMPUTE_BYTES", 0)
    pm = PackedBlockMask(ANCHORS, K, S, 4)
    _, t, length = pm.shape
    q, k, v, sink = _qkv(4, 2, t, length)
    ref = masked_attention(q, k, v, pm.dense(), 0.35, sink)
    got = masked_attention(q, k, v, pm, 0.35, sink, query_chunk=6)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)
    for a, b in zip(torch.autograd.grad(got.square().sum(), [q, k, v, sink]),
                    torch.autograd.grad(ref.square().sum(), [q, k, v, sink])):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
