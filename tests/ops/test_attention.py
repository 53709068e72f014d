"""masked_attention vs a naive per-row loop (sink, GQA/MQA, fully masked rows, chunking)."""

import math

import pytest
import torch

from dspark.ops.attention import masked_attention


def _naive(q, k, v, mask, scale, sink):
    """Row-by-row softmax with the sink in the denominator; an empty row gives zeros."""
    b_, hq, t_, _ = q.shape
    hk = k.shape[1]
    out = torch.zeros(b_, hq, t_, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kv_h = h // (hq // hk)
            for t in range(t_):
                keys = [j for j in range(k.shape[2]) if mask[b, t, j]]
                logits = [scale * float(q[b, h, t].double() @ k[b, kv_h, j].double()) for j in keys]
                denom = sum(math.exp(x) for x in logits) + (math.exp(float(sink[h])) if sink is not None else 0.0)
                for j, x in zip(keys, logits):
                    out[b, h, t] += math.exp(x) / denom * v[b, kv_h, j].double()
    return out.float()


@pytest.mark.parametrize("hq,hk", [(4, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("with_sink", [True, False])
def test_matches_naive_loop(hq, hk, with_sink):
    g = torch.Generator().manual_seed(hq * 10 + hk)
    b, t, length, d = 2, 5, 7, 6
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hk, length, d, generator=g)
    v = torch.randn(b, hk, length, 3, generator=g)
    mask = torch.rand(b, t, length, generator=g) > 0.4
    mask[0, 1] = False  # a row with no visible key
    sink = torch.randn(hq, generator=g) if with_sink else None
    out = masked_attention(q, k, v, mask, scale=0.7, sink=sink)
    ref = _naive(q, k, v, mask, 0.7, sink)
    assert out.shape == (b, hq, t, 3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, :, 1], torch.zeros(hq, 3))


def test_chunked_equals_unchunked_and_grads_finite():
    g = torch.Generator().manual_seed(0)
    b, hq, t, length, d = 2, 4, 9, 12, 8
    q = torch.randn(b, hq, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, 1, length, d, generator=g, requires_grad=True)
    mask = torch.rand(b, t, length, generator=g) > 0.5
    mask[1, 3] = False
    sink = torch.randn(hq, generator=g, requires_grad=True)
    full = masked_attention(q, k, k, mask, scale=d**-0.5, sink=sink, query_chunk=t)
    for chunk in (1, 2, 4):
        part = masked_attention(q, k, k, mask, scale=d**-0.5, sink=sink, query_chunk=chunk)
        torch.testing.assert_close(part, full, atol=1e-6, rtol=1e-6)
    full.square().sum().backward()
    for grad in (q.grad, k.grad, sink.grad):
        assert torch.isfinite(grad).all()
    # No sink and an empty row: still finite gradients.
    q.grad = None
    masked_attention(q, k, k, mask, scale=1.0).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_sink_matches_softmax_with_extra_zero_value_key():
    """A sink logit s_h equals an extra always-visible key whose logit is s_h and whose value is 0."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 5, generator=g)
    k = torch.randn(1, 1, 6, 5, generator=g)
    v = torch.randn(1, 1, 6, 5, generator=g)
    sink = torch.randn(2, generator=g)
    mask = torch.ones(1, 4, 6, dtype=torch.bool)
    out = masked_attention(q, k, v, mask, scale=1.0, sink=sink)
    logits = torch.einsum("bhtd,bld->bhtl", q, k[:, 0])
    logits = torch.cat([logits, sink.view(1, 2, 1, 1).expand(1, 2, 4, 1)], dim=-1)
    ref = torch.einsum("bhtl,bld->bhtd", logits.softmax(-1)[..., :-1], v[:, 0])
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_bad_shapes_raise():
    q = torch.zeros(1, 3, 2, 4)
    k = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="multiple"):
        masked_attention(q, k, k, torch.ones(1, 2, 5, dtype=torch.bool), scale=1.0)
    with pytest.raises(ValueError, match="mask"):
        masked_attention(q, k[:, :1], k[:, :1], torch.ones(1, 2, 4, dtype=torch.bool), scale=1.0)


@pytest.mark.parametrize("hq,hk", [(4, 1), (4, 4)])
@pytest.mark.parametrize("with_sink", [True, False])
def test_flex_backend_equals_reference(hq, hk, with_sink):
    """The CUDA backend (flex_attention, here in eager mode on CPU) gives the reference's numbers,
    including the sink folded in from the log-sum-exp and rows with no visible key."""
    from dspark.models.block_draft import block_attention_mask

    torch.manual_seed(0)
    B, S, A, L, D = 2, 20, 3, 4, 16
    anchors = torch.tensor([[0, 7, 15], [2, 3, 19]])
    mask = block_attention_mask(anchors, L, S, window=5)  # [B, 12, 32], packed blocks
    mask[1, 0] = False  # a row with no visible key
    T = A * L
    q, k, v = torch.randn(B, hq, T, D), torch.randn(B, hk, S + T, D), torch.randn(B, hk, S + T, D)
    sink = torch.randn(hq) if with_sink else None
    ref = masked_attention(q, k, v, mask, 0.25, sink, backend="reference")
    flex = masked_attention(q, k, v, mask, 0.25, sink, backend="flex")
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)
    assert flex[1, :, 0].abs().max() == 0
