"""The tilelang kernels without a GPU.

1. Every kernel lowers and compiles to an sm_90a cubin with the machine's nvcc; the cubins are checked to
   be CUDA ELF objects for SM 90 that contain the kernel.
2. The same kernel sources built for tilelang's C backend (cpu=True: fragments -> buffers, tile
   reductions -> loops, see dspark/ops/kernels/tl_common.py) RUN on the CPU and match the torch
   references: the fused-loss row kernel, the full chunked wrapper with its gradients, the six mHC pieces
   and hc_pre / hc_post / hc_head end to end (forward and backward).
Skips, naming the reason, when tilelang (pip install -e '.[kernels]') or, for 1, nvcc is absent.
"""
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from dspark.ops.backend import tilelang_available
from dspark.ops.kernels import find_nvcc

import torch

from conftest import assert_same_argmax

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not tilelang_available(), reason="tilelang not installed (pip install -e '.[kernels]')"),
]
needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (no CUDA toolkit: set CUDA_HOME or PATH)")

EM_CUDA = 190


def _kernels() -> dict:
    from dspark.ops.kernels import fused_loss_tl, mhc_tl

    ks = {f"mhc.{k}": f for k, f in mhc_tl.build_all(hc=4, H=512, dtype="bfloat16").items()}
    ks["mhc.post_fwd_fp32_block"] = mhc_tl.post_fwd_kernel(4, 512, "bfloat16", "float32")
    ks["loss.rows_grad"] = fused_loss_tl.lm_rows_kernel(3000, with_grad=True)
    ks["loss.rows_nograd"] = fused_loss_tl.lm_rows_kernel(3000, with_grad=False)
    return ks


@pytest.fixture(scope="module")
def cubins() -> dict:
    from dspark.ops.kernels import compile_for_arch

    ks = _kernels()
    with ThreadPoolExecutor(max_workers=2) as pool:  # nvcc is single-threaded; CI has 2 cores
        futs = {name: pool.submit(compile_for_arch, f, "sm_90a") for name, f in ks.items()}
        out = {}
        for name, fut in futs.items():
            try:
                out[name] = fut.result()
            except Exception as e:  # reported per kernel by the test below
                out[name] = e
    return out


@needs_nvcc
@pytest.mark.parametrize("name", sorted(_kernels()) if tilelang_available() else [])
def test_kernel_compiles_for_sm90a(cubins, name):
    blob = cubins[name]
    if isinstance(blob, Exception):
        raise blob
    assert blob[:4] == b"\x7fELF", name
    assert struct.unpack_from("<H", blob, 18)[0] == EM_CUDA  # e_machine
    assert (struct.unpack_from("<I", blob, 48)[0] >> 8) & 0xFF == 90  # e_flags: SM version
    assert b"_kernel" in blob


@needs_nvcc
def test_lowered_source_uses_the_target_features():
    """The lowering really targets CUDA: the generated source is a __global__ kernel with the fused math."""
    from dspark.ops.kernels import lower_for_arch
    from dspark.ops.kernels.fused_loss_tl import lm_rows_kernel

    src = lower_for_arch(lm_rows_kernel(3000), "sm_90a")
    assert "__global__" in src and "expf" in src and "AllReduce" in src


# ---- 2. the kernels run on the CPU (tilelang C backend) against the torch references ----------------
def test_loss_rows_kernel_matches_torch_on_cpu():
    """Row kernel on hand-sized logits: several vocabulary tiles plus a tail, and an argmax tie."""
    import tilelang

    from dspark.ops.kernels.fused_loss_tl import lm_rows_kernel

    g = torch.Generator().manual_seed(0)
    R, V = 6, 37
    d, t = torch.randn(R, V, generator=g) * 3, torch.randn(R, V, generator=g) * 3
    d[2, 5] = d[2, 9] = 50.0  # tie: the first index wins, as in torch.argmax
    lab = torch.randint(0, V, (R,), generator=g, dtype=torch.int32)
    a, b = torch.rand(R, generator=g), torch.rand(R, generator=g)
    ce, l1 = torch.empty(R), torch.empty(R)
    ad, at = torch.empty(R, dtype=torch.int32), torch.empty(R, dtype=torch.int32)
    dd = torch.empty(R, V)
    k = tilelang.compile(lm_rows_kernel(V, True, "float32", BV=16, cpu=True), target="c")
    k(d, t, lab, a, b, ce, l1, ad, at, dd)
    q, p = d.softmax(-1), t.softmax(-1)
    s = torch.sign(q - p)
    expect = q * (a[:, None] + b[:, None] * (s - (q * s).sum(-1, keepdim=True)))
    expect[torch.arange(R), lab.long()] -= a
    torch.testing.assert_close(ce, -torch.log_softmax(d, -1)[torch.arange(R), lab.long()])
    torch.testing.assert_close(l1, (q - p).abs().sum(-1))
    assert ad.tolist() == d.argmax(-1).tolist() and ad[2] == 5 and at.tolist() == t.argmax(-1).tolist()
    torch.testing.assert_close(dd, expect)


@pytest.mark.parametrize("markov", [True, False])
def test_lm_loss_through_the_kernel_matches_reference_on_cpu(markov):
    from dspark.ops.fused_loss import lm_loss_reference
    from dspark.ops.kernels.fused_loss_tl import lm_loss_with_kernel

    g = torch.Generator().manual_seed(1)
    N, H, V, R = 9, 6, 37, 3
    x, y, w = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    e, w2 = (torch.randn(N, R, generator=g), torch.randn(V, R, generator=g)) if markov else (None, None)
    labels = torch.randint(0, V, (N,), generator=g)
    a, b = torch.rand(N, generator=g), torch.rand(N, generator=g)
    ref = lm_loss_reference(x, y, w, e, w2, labels, a, b, chunk_rows=N)
    got = lm_loss_with_kernel("c", x, y, w, e, w2, labels, a, b, chunk_rows=4, need_grads=True)
    for name in ("ce", "l1", "grad_x", "grad_latent", "grad_w2"):
        r, o = getattr(ref, name), getattr(got, name)
        assert (r is None) == (o is None), name
        if r is not None:
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    d_logits = x @ w.T + (e @ w2.T if markov else 0)  # kernel (4-row chunks) vs reference (one chunk)
    assert_same_argmax(got.draft_argmax, ref.draft_argmax, d_logits)
    assert_same_argmax(got.teacher_argmax, ref.teacher_argmax, y @ w.T)
    nograd = lm_loss_with_kernel("c", x, y, w, e, w2, labels, a, b, chunk_rows=4, need_grads=False)
    torch.testing.assert_close(nograd.l1, ref.l1, atol=1e-5, rtol=1e-5)


def test_mhc_pieces_c_backend_match_torch():
    from dspark.ops.kernels.mhc_tl import make_ops
    from dspark.ops.mhc import TORCH_OPS as TO

    tl = make_ops("c")
    g = torch.Generator().manual_seed(2)
    Tn, hc, H = 5, 3, 8  # Tn not a multiple of the 32-token tile: the tail guards run
    M = (2 + hc) * hc
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, fn, f = r(Tn, hc, H), r(M, hc * H) * 0.3, r(Tn, H)
    w, post, comb = torch.rand(Tn, hc, generator=g), r(Tn, hc), torch.rand(Tn, hc, hc, generator=g)
    flat = x.flatten(-2).contiguous()
    mix, inv = TO["mix_fwd"](flat, fn, 1e-6)
    dmix, dy, dout = r(Tn, M), r(Tn, H), r(Tn, hc, H)
    calls = {
        "mix_fwd": (flat, fn, 1e-6), "mix_bwd": (dmix, flat, fn, mix, inv), "collapse_fwd": (x, w),
        "collapse_bwd": (dy, x, w), "post_fwd": (f, x, post, comb), "post_bwd": (dout, f, x, post, comb),
    }
    for name, args in calls.items():
        got, ref = tl[name](*args), TO[name](*args)
        got, ref = (got, ref) if isinstance(ref, tuple) else ((got,), (ref,))
        for o, e in zip(got, ref):
            torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5, msg=name)
            assert e.abs().sum() > 0, name


def test_hc_ops_through_c_kernels_match_reference(monkeypatch):
    from dspark.ops import mhc
    from dspark.ops.kernels.mhc_tl import make_ops

    monkeypatch.setattr(mhc, "_ops", lambda x, backend: make_ops("c"))
    g = torch.Generator().manual_seed(3)
    hc, H = 3, 8
    mixn = (2 + hc) * hc
    x = torch.randn(2, 3, hc, H, generator=g)
    fn, base, scale = torch.randn(mixn, hc * H, generator=g) * 0.3, torch.randn(mixn, generator=g), torch.rand(3) + 0.5
    hfn, hbase, hscale = torch.randn(hc, hc * H, generator=g), torch.randn(hc, generator=g), torch.rand(1) + 0.5
    weight = torch.randn(2, 3, H, generator=g)

    def run(pre, post_fn, head):
        leaves = [t.clone().requires_grad_(True) for t in (x, fn, hfn)]
        y, post, comb = pre(leaves[0], leaves[1], base, scale, mhc.HcSettings(hc, 5, 1e-6, 1e-6))
        out = post_fn(torch.tanh(y), leaves[0], post, comb)
        z = head(out, leaves[2], hbase, hscale, 1e-6, 1e-6)
        (z * weight).sum().backward()
        return z.detach(), [t.grad for t in leaves]

    ref = run(mhc.hc_pre_reference, mhc.hc_post_reference, mhc.hc_head_reference)
    got = run(mhc.hc_pre, mhc.hc_post, mhc.hc_head)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
