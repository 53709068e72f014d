"""mHC pieces with explicit backward (the interface the tilelang kernels implement) against autograd of
the reference math: gradcheck in float64, and full hc_pre / hc_post / hc_head gradients vs the references."""
import pytest
import torch

from dspark.ops import mhc
from dspark.ops.mhc import TORCH_OPS, CollapseFn, MixFn, PostFn

HC, H, T = 3, 5, 4
EPS, NORM_EPS = 1e-6, 1e-6


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_mix_gradcheck():
    x = torch.randn(T, HC * H, generator=_g(0), dtype=torch.float64, requires_grad=True)
    fn = torch.randn(7, HC * H, generator=_g(1), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: MixFn.apply(a, b, NORM_EPS, TORCH_OPS), (x, fn))


def test_collapse_gradcheck():
    x = torch.randn(T, HC, H, generator=_g(2), dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, HC, generator=_g(3), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: CollapseFn.apply(a, b, TORCH_OPS), (x, w))


def test_post_gradcheck():
    g = _g(4)
    f = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, HC, H, generator=g, dtype=torch.float64, requires_grad=True)
    post = torch.rand(T, HC, generator=g, dtype=torch.float64, requires_grad=True)
    comb = torch.rand(T, HC, HC, generator=g, dtype=torch.float64, requires_grad=True)  # not symmetric
    assert torch.autograd.gradcheck(lambda *a: PostFn.apply(*a, TORCH_OPS), (f, x, post, comb))


def _grads(fn, inputs):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = _g(9)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, inputs)


def _leaf(t):
    return t.clone().requires_grad_(True)


def test_hc_pre_forward_and_gradients_match_reference():
    g = _g(5)
    mixn = (2 + HC) * HC
    x = torch.randn(2, 3, HC, H, generator=g)
    fn, base = torch.randn(mixn, HC * H, generator=g) * 0.5, torch.randn(mixn, generator=g) * 0.3
    scale = torch.rand(3, generator=g) + 0.5
    args = lambda: [_leaf(t) for t in (x, fn, base, scale)]  # noqa: E731
    ref_out, ref_g = _grads(lambda *a: mhc.hc_pre_reference(*a, mhc.HcSettings(HC, 6, EPS, NORM_EPS)), args())
    out, got = _grads(lambda *a: mhc.hc_pre(*a, mhc.HcSettings(HC, 6, EPS, NORM_EPS), backend="torch"), args())
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref_g):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert b.abs().sum() > 0


def test_hc_post_and_head_gradients_match_reference():
    g = _g(6)
    f, res = torch.randn(2, 3, H, generator=g), torch.randn(2, 3, HC, H, generator=g)
    post, comb = torch.rand(2, 3, HC, generator=g) * 2, torch.rand(2, 3, HC, HC, generator=g)
    args = lambda: [_leaf(t) for t in (f, res, post, comb)]  # noqa: E731
    ref_out, ref_g = _grads(mhc.hc_post_reference, args())
    out, got = _grads(lambda *a: mhc.hc_post(*a, backend="torch"), args())
    torch.testing.assert_close(out[0], ref_out[0])
    for a, b in zip(got, ref_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    hfn, hbase, hscale = torch.randn(HC, HC * H, generator=g), torch.randn(HC, generator=g), torch.rand(1, generator=g)
    args = lambda: [_leaf(t) for t in (res, hfn, hbase, hscale)]  # noqa: E731
    ref_out, ref_g = _grads(lambda *a: mhc.hc_head_reference(*a, EPS, NORM_EPS), args())
    out, got = _grads(lambda *a: mhc.hc_head(*a, EPS, NORM_EPS, backend="torch"), args())
    torch.testing.assert_close(out[0], ref_out[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref_g):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_streams_keep_dtypes_and_grads():
    g = _g(7)
    mixn = (2 + HC) * HC
    x = torch.randn(2, HC, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    fn = (torch.randn(mixn, HC * H, generator=g) * 0.5).requires_grad_(True)
    y, post, comb = mhc.hc_pre(x, fn, torch.zeros(mixn), torch.ones(3), mhc.HcSettings(HC, 3, EPS, NORM_EPS), backend="torch")
    assert y.dtype == torch.bfloat16 and post.dtype == torch.float32
    out = mhc.hc_post(y, x, post, comb, backend="torch")
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and fn.grad.dtype == torch.float32


def test_tilelang_backend_refuses_cpu_tensors():
    x = torch.randn(2, HC, H)
    with pytest.raises(RuntimeError, match="ops_backend=tilelang needs CUDA"):
        mhc.hc_head(x, torch.randn(HC, HC * H), torch.zeros(HC), torch.ones(1), EPS, NORM_EPS, backend="tilelang")
