"""tilelang kernels for the memory-bound mHC pieces (forward and backward), same contracts as the torch
versions in dspark.ops.mhc (mix_*, collapse_*, post_*): fp32 math, streams in their own dtype.

Shapes: T tokens (dynamic), hc streams, H hidden, K = hc*H, M mix outputs. Every kernel reads its big
operand (the streams) exactly once:
  mix_fwd      grid (ceil(T/BT),)      x [T, K], fn [M, K]          -> mix [T, M], inv [T]
  mix_bwd      grid (K/BK, ceil(T/BT)) dmix, x, fn, mix, inv        -> dx [T, K], dfn [M, K] (atomic over T)
  collapse_fwd grid (H/BH, T)          x [T, hc, H], w [T, hc]      -> y [T, H]
  collapse_bwd grid (T,)               dy, x, w                     -> dx [T, hc, H], dw [T, hc]
  post_fwd     grid (H/BH, T)          F [T, H], x, post, comb      -> out [T, hc, H]
  post_bwd     grid (T,)               dout, F, x, post, comb       -> dF, dx, dpost, dcomb
The kernel builders are pure (no GPU needed): `build_all(...)` returns the prim_funcs that
tests/ops/test_kernel_compile.py lowers and compiles for sm_90a.
"""
# No `from __future__ import annotations`: tilelang reads the T.Tensor annotations as live objects.


import functools

import torch

from dspark.ops.limits import check_int32_addressable

from dspark.ops.kernels.tl_common import alloc_frag, alloc_smem, clear, reduce_last

F32 = "float32"
_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tile(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n (kernels require exact tiling of the hidden axes)."""
    t = 1
    while t * 2 <= cap and n % (t * 2) == 0:
        t *= 2
    return t


def _tl():
    import tilelang
    import tilelang.language as T

    return tilelang, T


# ---- mix: (x @ fn^T) * rsqrt(mean(x^2) + eps) ------------------------------------------------------
def mix_fwd_kernel(K: int, M: int, norm_eps: float, dtype: str, BT: int = 32, BK: int = 64, threads: int = 128, cpu: bool = False):
    _, T = _tl()
    BK = _tile(K, BK)
    NT = T.dynamic("T")

    @T.prim_func
    def mix_fwd(X: T.Tensor((NT, K), dtype), FN: T.Tensor((M, K), F32),
                MIX: T.Tensor((NT, M), F32), INV: T.Tensor((NT,), F32)):
        with T.Kernel(T.ceildiv(NT, BT), threads=threads) as bt:
            xs = alloc_smem((BT, BK), F32, cpu)
            fs = alloc_smem((M, BK), F32, cpu)
            acc = alloc_frag((BT, M), F32, cpu)
            ss = alloc_frag((BT,), F32, cpu)
            clear(acc, cpu)
            clear(ss, cpu)
            for kt in T.serial(K // BK):
                for i, k in T.Parallel(BT, BK):
                    xs[i, k] = T.if_then_else(bt * BT + i < NT, T.cast(X[bt * BT + i, kt * BK + k], F32), 0.0)
                for m, k in T.Parallel(M, BK):
                    fs[m, k] = FN[m, kt * BK + k]
                for i, m in T.Parallel(BT, M):
                    for k in T.serial(BK):
                        acc[i, m] += xs[i, k] * fs[m, k]
                for i in T.Parallel(BT):
                    for k in T.serial(BK):
                        ss[i] += xs[i, k] * xs[i, k]
            for i, m in T.Parallel(BT, M):
                if bt * BT + i < NT:
                    MIX[bt * BT + i, m] = acc[i, m] * T.rsqrt(ss[i] / K + norm_eps)
            for i in T.Parallel(BT):
                if bt * BT + i < NT:
                    INV[bt * BT + i] = T.rsqrt(ss[i] / K + norm_eps)

    return mix_fwd


def mix_bwd_kernel(K: int, M: int, dtype: str, BT: int = 32, BK: int = 128, threads: int = 128, cpu: bool = False):
    """dx = draw @ fn - coef * x and dfn += draw^T x with draw = dmix * inv,
    coef = (sum_m dmix mix) / inv * inv^3 / K = (sum_m dmix mix) * inv^2 / K."""
    _, T = _tl()
    BK = _tile(K, BK)
    NT = T.dynamic("T")

    @T.prim_func
    def mix_bwd(DMIX: T.Tensor((NT, M), F32), X: T.Tensor((NT, K), dtype), FN: T.Tensor((M, K), F32),
                MIX: T.Tensor((NT, M), F32), INV: T.Tensor((NT,), F32),
                DX: T.Tensor((NT, K), F32), DFN: T.Tensor((M, K), F32)):
        with T.Kernel(K // BK, T.ceildiv(NT, BT), threads=threads) as (bk, bt):
            draw = alloc_smem((BT, M), F32, cpu)
            coef = alloc_smem((BT,), F32, cpu)
            xs = alloc_smem((BT, BK), F32, cpu)
            dfn = alloc_frag((M, BK), F32, cpu)
            for i, m in T.Parallel(BT, M):
                draw[i, m] = T.if_then_else(bt * BT + i < NT, DMIX[bt * BT + i, m] * INV[bt * BT + i], 0.0)
            for i in T.Parallel(BT):
                coef[i] = 0.0
                if bt * BT + i < NT:
                    for m in T.serial(M):
                        coef[i] += DMIX[bt * BT + i, m] * MIX[bt * BT + i, m]
                    coef[i] = coef[i] * INV[bt * BT + i] * INV[bt * BT + i] / K
            for i, k in T.Parallel(BT, BK):
                xs[i, k] = T.if_then_else(bt * BT + i < NT, T.cast(X[bt * BT + i, bk * BK + k], F32), 0.0)
            for i, k in T.Parallel(BT, BK):
                if bt * BT + i < NT:
                    v = T.alloc_var(F32, init=0.0)
                    for m in T.serial(M):
                        v += draw[i, m] * FN[m, bk * BK + k]
                    DX[bt * BT + i, bk * BK + k] = v - coef[i] * xs[i, k]
            clear(dfn, cpu)
            for m, k in T.Parallel(M, BK):
                for i in T.serial(BT):
                    dfn[m, k] += draw[i, m] * xs[i, k]
            for m, k in T.Parallel(M, BK):
                T.atomic_add(DFN[m, bk * BK + k], dfn[m, k])

    return mix_bwd


# ---- collapse: y = sum_j w_j x_j -------------------------------------------------------------------
def collapse_fwd_kernel(hc: int, H: int, dtype: str, BH: int = 256, threads: int = 128, cpu: bool = False):
    _, T = _tl()
    BH = _tile(H, BH)
    NT = T.dynamic("T")

    @T.prim_func
    def collapse_fwd(X: T.Tensor((NT, hc, H), dtype), W: T.Tensor((NT, hc), F32), Y: T.Tensor((NT, H), dtype)):
        with T.Kernel(H // BH, NT, threads=threads) as (bh, t):
            for i in T.Parallel(BH):
                v = T.alloc_var(F32, init=0.0)
                for j in T.serial(hc):
                    v += W[t, j] * T.cast(X[t, j, bh * BH + i], F32)
                Y[t, bh * BH + i] = T.cast(v, dtype)

    return collapse_fwd


def collapse_bwd_kernel(hc: int, H: int, dtype: str, BH: int = 256, threads: int = 128, cpu: bool = False):
    _, T = _tl()
    BH = _tile(H, BH)
    NT = T.dynamic("T")

    @T.prim_func
    def collapse_bwd(DY: T.Tensor((NT, H), dtype), X: T.Tensor((NT, hc, H), dtype), W: T.Tensor((NT, hc), F32),
                     DX: T.Tensor((NT, hc, H), F32), DW: T.Tensor((NT, hc), F32)):
        with T.Kernel(NT, threads=threads) as t:
            acc = alloc_frag((hc, BH), F32, cpu)
            red = alloc_frag((hc,), F32, cpu)
            clear(acc, cpu)
            for ht in T.serial(H // BH):
                for j, i in T.Parallel(hc, BH):
                    dy = T.cast(DY[t, ht * BH + i], F32)
                    DX[t, j, ht * BH + i] = W[t, j] * dy
                    acc[j, i] += dy * T.cast(X[t, j, ht * BH + i], F32)
            reduce_last("sum", acc, red, cpu)
            for j in T.Parallel(hc):
                DW[t, j] = red[j]

    return collapse_bwd


# ---- post: out_k = post_k F + sum_j comb[j, k] x_j --------------------------------------------------
def post_fwd_kernel(hc: int, H: int, dtype: str, fdtype: str | None = None, BH: int = 256, threads: int = 128, cpu: bool = False):
    _, T = _tl()
    BH = _tile(H, BH)
    fdtype = fdtype or dtype
    NT = T.dynamic("T")

    @T.prim_func
    def post_fwd(FB: T.Tensor((NT, H), fdtype), X: T.Tensor((NT, hc, H), dtype), P: T.Tensor((NT, hc), F32),
                 C: T.Tensor((NT, hc, hc), F32), OUT: T.Tensor((NT, hc, H), dtype)):
        with T.Kernel(H // BH, NT, threads=threads) as (bh, t):
            for k, i in T.Parallel(hc, BH):
                v = T.alloc_var(F32, init=0.0)
                v = P[t, k] * T.cast(FB[t, bh * BH + i], F32)
                for j in T.serial(hc):
                    v += C[t, j, k] * T.cast(X[t, j, bh * BH + i], F32)
                OUT[t, k, bh * BH + i] = T.cast(v, dtype)

    return post_fwd


def post_bwd_kernel(hc: int, H: int, dtype: str, fdtype: str | None = None, BH: int = 128, threads: int = 128, cpu: bool = False):
    _, T = _tl()
    BH = _tile(H, BH)
    fdtype = fdtype or dtype
    NT = T.dynamic("T")

    @T.prim_func
    def post_bwd(DOUT: T.Tensor((NT, hc, H), dtype), FB: T.Tensor((NT, H), fdtype), X: T.Tensor((NT, hc, H), dtype),
                 P: T.Tensor((NT, hc), F32), C: T.Tensor((NT, hc, hc), F32),
                 DF: T.Tensor((NT, H), F32), DX: T.Tensor((NT, hc, H), F32),
                 DP: T.Tensor((NT, hc), F32), DC: T.Tensor((NT, hc, hc), F32)):
        with T.Kernel(NT, threads=threads) as t:
            accp = alloc_frag((hc, BH), F32, cpu)
            accc = alloc_frag((hc, hc, BH), F32, cpu)
            redp = alloc_frag((hc,), F32, cpu)
            redc = alloc_frag((hc, hc), F32, cpu)
            clear(accp, cpu)
            clear(accc, cpu)
            for ht in T.serial(H // BH):
                for k, i in T.Parallel(hc, BH):
                    accp[k, i] += T.cast(DOUT[t, k, ht * BH + i], F32) * T.cast(FB[t, ht * BH + i], F32)
                for j, k, i in T.Parallel(hc, hc, BH):
                    accc[j, k, i] += T.cast(X[t, j, ht * BH + i], F32) * T.cast(DOUT[t, k, ht * BH + i], F32)
                for i in T.Parallel(BH):
                    v = T.alloc_var(F32, init=0.0)
                    for k in T.serial(hc):
                        v += P[t, k] * T.cast(DOUT[t, k, ht * BH + i], F32)
                    DF[t, ht * BH + i] = v
                for j, i in T.Parallel(hc, BH):
                    v = T.alloc_var(F32, init=0.0)
                    for k in T.serial(hc):
                        v += C[t, j, k] * T.cast(DOUT[t, k, ht * BH + i], F32)
                    DX[t, j, ht * BH + i] = v
            reduce_last("sum", accp, redp, cpu)
            reduce_last("sum", accc, redc, cpu)
            for k in T.Parallel(hc):
                DP[t, k] = redp[k]
            for j, k in T.Parallel(hc, hc):
                DC[t, j, k] = redc[j, k]

    return post_bwd


def build_all(hc: int = 4, H: int = 4096, dtype: str = "bfloat16", norm_eps: float = 1e-6) -> dict:
    """Every mHC prim_func for one configuration (V4-Flash: hc 4, H 4096, bf16 streams)."""
    K, M = hc * H, (2 + hc) * hc
    return {
        "mix_fwd": mix_fwd_kernel(K, M, norm_eps, dtype),
        "mix_fwd_head": mix_fwd_kernel(K, hc, norm_eps, dtype),
        "mix_bwd": mix_bwd_kernel(K, M, dtype),
        "mix_bwd_head": mix_bwd_kernel(K, hc, dtype),
        "collapse_fwd": collapse_fwd_kernel(hc, H, dtype),
        "collapse_bwd": collapse_bwd_kernel(hc, H, dtype),
        "post_fwd": post_fwd_kernel(hc, H, dtype),
        "post_bwd": post_bwd_kernel(hc, H, dtype),
    }


# ---- runtime: compiled kernels behind the TORCH_OPS interface --------------------------------------
_BUILDERS = {"mix_fwd": mix_fwd_kernel, "mix_bwd": mix_bwd_kernel, "collapse_fwd": collapse_fwd_kernel,
             "collapse_bwd": collapse_bwd_kernel, "post_fwd": post_fwd_kernel, "post_bwd": post_bwd_kernel}


@functools.lru_cache(maxsize=None)
def _compiled(target: str, name: str, *key):
    """Kernel `name` built for `key`, compiled for "cuda" or for tilelang's C backend ("c", CPU tests)."""
    tilelang, _ = _tl()
    return tilelang.compile(_BUILDERS[name](*key, cpu=target == "c"), target=target)


def _dt(t: torch.Tensor) -> str:
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"mHC tilelang kernels support {list(_TORCH_DTYPES)}, got {t.dtype}")
    return _TORCH_DTYPES[t.dtype]


def _c(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A kernel operand: contiguous, in `dtype`, and small enough for the kernels' int32 offsets."""
    check_int32_addressable(t.numel(), f"mHC kernel operand {tuple(t.shape)}")
    return (t if dtype is None else t.to(dtype)).contiguous()


def make_ops(target: str = "cuda") -> dict:
    """The six pieces as torch functions running the kernels compiled for `target` (same contracts as
    dspark.ops.mhc.TORCH_OPS)."""
    f32 = torch.float32

    def mix_fwd(x, fn, norm_eps):
        n, k = x.shape
        m = fn.shape[0]
        mix = torch.empty(n, m, device=x.device, dtype=f32)
        inv = torch.empty(n, device=x.device, dtype=f32)
        _compiled(target, "mix_fwd", k, m, float(norm_eps), _dt(x))(_c(x), _c(fn, f32), mix, inv)
        return mix, inv

    def mix_bwd(dmix, x, fn, mix, inv):
        n, k = x.shape
        m = fn.shape[0]
        dx = torch.empty(n, k, device=x.device, dtype=f32)
        dfn = torch.zeros(m, k, device=x.device, dtype=f32)
        _compiled(target, "mix_bwd", k, m, _dt(x))(_c(dmix, f32), _c(x), _c(fn, f32), _c(mix), _c(inv), dx, dfn)
        return dx, dfn

    def collapse_fwd(x, w):
        n, hc, h = x.shape
        y = torch.empty(n, h, device=x.device, dtype=x.dtype)
        _compiled(target, "collapse_fwd", hc, h, _dt(x))(_c(x), _c(w, f32), y)
        return y

    def collapse_bwd(dy, x, w):
        n, hc, h = x.shape
        dx = torch.empty(n, hc, h, device=x.device, dtype=f32)
        dw = torch.empty(n, hc, device=x.device, dtype=f32)
        _compiled(target, "collapse_bwd", hc, h, _dt(x))(_c(dy, x.dtype), _c(x), _c(w, f32), dx, dw)
        return dx, dw

    def post_fwd(f, x, post, comb):
        n, hc, h = x.shape
        out = torch.empty(n, hc, h, device=x.device, dtype=x.dtype)
        _compiled(target, "post_fwd", hc, h, _dt(x), _dt(f))(_c(f), _c(x), _c(post, f32), _c(comb, f32), out)
        return out

    def post_bwd(dout, f, x, post, comb):
        n, hc, h = x.shape
        df = torch.empty(n, h, device=x.device, dtype=f32)
        dx = torch.empty(n, hc, h, device=x.device, dtype=f32)
        dp = torch.empty(n, hc, device=x.device, dtype=f32)
        dc = torch.empty(n, hc, hc, device=x.device, dtype=f32)
        _compiled(target, "post_bwd", hc, h, _dt(x), _dt(f))(_c(dout, x.dtype), _c(f), _c(x), _c(post, f32),
                                                             _c(comb, f32), df, dx, dp, dc)
        return df, dx, dp, dc

    return {"mix_fwd": mix_fwd, "mix_bwd": mix_bwd, "collapse_fwd": collapse_fwd, "collapse_bwd": collapse_bwd,
            "post_fwd": post_fwd, "post_bwd": post_bwd}


TILELANG_OPS = make_ops("cuda")
