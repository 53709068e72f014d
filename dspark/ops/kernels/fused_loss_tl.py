"""tilelang kernel for the fused DSpark LM loss (CUDA); same contract as lm_loss_reference.

Per chunk of rows (chunk_rows, default 512 here) the logits of the chunk come from the tensor cores
(cuBLAS via torch, in the LM head's dtype, exactly as the draft computes them), and one tilelang
kernel does all the row math in 3 streaming passes over the vocabulary, one CTA per row:
  pass 1: per-lane online max / sum-exp of draft and teacher logits, running argmax  -> LSEs, argmaxes
  pass 2: q = exp(d - lse_d), p = exp(t - lse_t): sum |q - p| and c = sum q sign(q - p)
  pass 3: dD = a (q - onehot(label)) + b q (sign(q - p) - c), written in the LM head dtype
then grad x += dD W, grad e = dD W2, grad W2 += dD^T E on the tensor cores. Live memory per chunk:
two [chunk, V] fp32 logits + one [chunk, V] gradient in the weight dtype; never [N, V].
"""
# No `from __future__ import annotations`: tilelang reads the T.Tensor annotations as live objects.

import functools

import torch
import torch.nn.functional as F

from dspark.ops.lm_loss_io import LMLossParts, check_inputs
from dspark.ops.limits import check_float32_index, check_int32_addressable

F32 = "float32"
I32 = "int32"
GPU_CHUNK_ROWS = 512


def lm_rows_kernel(V: int, with_grad: bool = True, grad_dtype: str = "bfloat16", BV: int = 1024,
                   threads: int = 256, cpu: bool = False):
    """Row kernel: D, TL [R, V] fp32 logits, LAB [R] int32, A, B [R] fp32 coefficients ->
    CE, L1 [R] fp32, AD, AT [R] int32 argmaxes, DD [R, V] grad_dtype (with_grad; else an unused [1, V])."""
    import tilelang.language as T

    from dspark.ops.kernels.tl_common import alloc_frag, fabs, fexp, flog, reduce_last

    NR = T.dynamic("R")
    n_tiles = (V + BV - 1) // BV
    BIG = 3.0e38

    # one row's statistics from its BV per-lane ones ([1, BV] fragments -> [1]); red, tmp: scratch
    @T.macro
    def lanes_lse(m, z_sum, red, tmp, lse):
        """lse = the row's log-sum-exp, from the lanes' online max m and sum-exp z_sum (relative to m)."""
        reduce_last("max", m, red, cpu)
        for z, i in T.Parallel(1, BV):
            tmp[z, i] = z_sum[z, i] * fexp(m[z, i] - red[z], cpu)
        reduce_last("sum", tmp, lse, cpu)
        for z in T.Parallel(1):
            lse[z] = red[z] + flog(lse[z], cpu)

    @T.macro
    def lanes_argmax(best, best_idx, red, tmp, arg):
        """arg = the smallest index among the lanes holding the maximum best (torch's tie rule)."""
        reduce_last("max", best, red, cpu)
        for z, i in T.Parallel(1, BV):
            tmp[z, i] = T.if_then_else(best[z, i] == red[z], best_idx[z, i], T.cast(V, F32))
        reduce_last("min", tmp, arg, cpu)

    @T.prim_func
    def lm_rows(D: T.Tensor((NR, V), F32), TL: T.Tensor((NR, V), F32), LAB: T.Tensor((NR,), I32),
                A: T.Tensor((NR,), F32), B: T.Tensor((NR,), F32),
                CE: T.Tensor((NR,), F32), L1: T.Tensor((NR,), F32), AD: T.Tensor((NR,), I32),
                AT: T.Tensor((NR,), I32), DD: T.Tensor((NR if with_grad else 1, V), grad_dtype)):
        with T.Kernel(NR, threads=threads) as r:
            md = alloc_frag((1, BV), F32, cpu)
            zd = alloc_frag((1, BV), F32, cpu)
            mt = alloc_frag((1, BV), F32, cpu)
            zt = alloc_frag((1, BV), F32, cpu)
            bd = alloc_frag((1, BV), F32, cpu)  # per-lane best draft logit / its index
            bdi = alloc_frag((1, BV), F32, cpu)
            bt = alloc_frag((1, BV), F32, cpu)
            bti = alloc_frag((1, BV), F32, cpu)
            tmp = alloc_frag((1, BV), F32, cpu)
            red = alloc_frag((1,), F32, cpu)
            lse_d = alloc_frag((1,), F32, cpu)
            lse_t = alloc_frag((1,), F32, cpu)
            l1 = alloc_frag((1,), F32, cpu)
            cc = alloc_frag((1,), F32, cpu)
            arg_d = alloc_frag((1,), F32, cpu)
            arg_t = alloc_frag((1,), F32, cpu)
            for z, i in T.Parallel(1, BV):
                md[z, i] = -BIG
                mt[z, i] = -BIG
                zd[z, i] = 0.0
                zt[z, i] = 0.0
                bd[z, i] = -BIG
                bt[z, i] = -BIG
                bdi[z, i] = V
                bti[z, i] = V
            # pass 1: online softmax statistics and argmax, per lane
            for vt in T.serial(n_tiles):
                for z, i in T.Parallel(1, BV):
                    v = vt * BV + i
                    if v < V:
                        d = D[r, v]
                        t = TL[r, v]
                        m_new = T.max(md[z, i], d)
                        zd[z, i] = zd[z, i] * fexp(md[z, i] - m_new, cpu) + fexp(d - m_new, cpu)
                        md[z, i] = m_new
                        n_new = T.max(mt[z, i], t)
                        zt[z, i] = zt[z, i] * fexp(mt[z, i] - n_new, cpu) + fexp(t - n_new, cpu)
                        mt[z, i] = n_new
                        # index first, from the old best: the compiler may split these statements
                        # into separate loops, so no statement may read a value updated above it
                        bdi[z, i] = T.if_then_else(d > bd[z, i], T.cast(v, F32), bdi[z, i])
                        bd[z, i] = T.max(bd[z, i], d)
                        bti[z, i] = T.if_then_else(t > bt[z, i], T.cast(v, F32), bti[z, i])
                        bt[z, i] = T.max(bt[z, i], t)
            lanes_lse(md, zd, red, tmp, lse_d)
            lanes_lse(mt, zt, red, tmp, lse_t)
            lanes_argmax(bd, bdi, red, tmp, arg_d)
            lanes_argmax(bt, bti, red, tmp, arg_t)
            # pass 2: L1 and c = sum q sign(q - p)
            for z, i in T.Parallel(1, BV):
                zd[z, i] = 0.0
                zt[z, i] = 0.0
            for vt in T.serial(n_tiles):
                for z, i in T.Parallel(1, BV):
                    v = vt * BV + i
                    if v < V:
                        q = fexp(D[r, v] - lse_d[z], cpu)
                        p = fexp(TL[r, v] - lse_t[z], cpu)
                        zd[z, i] += fabs(q - p, cpu)
                        zt[z, i] += T.if_then_else(q > p, q, T.if_then_else(q < p, -q, 0.0))
            reduce_last("sum", zd, l1, cpu)
            reduce_last("sum", zt, cc, cpu)
            for z in T.Parallel(1):
                CE[r] = lse_d[z] - D[r, LAB[r]]
                L1[r] = l1[z]
                AD[r] = T.cast(arg_d[z], I32)
                AT[r] = T.cast(arg_t[z], I32)
            # pass 3: gradient of a ce + b l1 w.r.t. the draft logits
            if with_grad:
                for vt in T.serial(n_tiles):
                    for z, i in T.Parallel(1, BV):
                        v = vt * BV + i
                        if v < V:
                            q = fexp(D[r, v] - lse_d[z], cpu)
                            p = fexp(TL[r, v] - lse_t[z], cpu)
                            s = T.if_then_else(q > p, 1.0, T.if_then_else(q < p, -1.0, 0.0))
                            g = q * (A[r] + B[r] * (s - cc[z])) - T.if_then_else(v == LAB[r], A[r], 0.0)
                            DD[r, v] = T.cast(g, grad_dtype)

    return lm_rows


_TORCH_TO_TL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=None)
def _compiled(V: int, with_grad: bool, grad_dtype: str, target: str = "cuda"):
    """The row kernel compiled for "cuda", or for tilelang's C backend ("c", CPU tests)."""
    import tilelang

    cpu = target == "c"
    kernel = lm_rows_kernel(V, with_grad, grad_dtype, BV=64 if cpu else 1024, cpu=cpu)
    return tilelang.compile(kernel, target=target)


def lm_loss_tilelang(x, y, w, latent, w2, labels, coef_ce, coef_l1, *, chunk_rows=GPU_CHUNK_ROWS,
                     need_grads=True) -> LMLossParts:
    """lm_loss_reference's contract on CUDA tensors (chunks of at least 512 rows: the row kernel wants rows)."""
    check_inputs(x, y, w, latent, w2, labels, coef_ce, coef_l1)
    if not x.is_cuda:
        raise RuntimeError(f"lm_loss_tilelang needs CUDA tensors, got {x.device}")
    return lm_loss_with_kernel("cuda", x, y, w, latent, w2, labels, coef_ce, coef_l1,
                               chunk_rows=max(int(chunk_rows), GPU_CHUNK_ROWS), need_grads=need_grads)


def lm_loss_with_kernel(target, x, y, w, latent, w2, labels, coef_ce, coef_l1, *, chunk_rows, need_grads):
    """Chunk loop around the row kernel compiled for `target` ("cuda"; "c" runs it on the CPU)."""
    n, v = x.shape[0], w.shape[0]
    chunk = int(chunk_rows)
    check_float32_index(v, "fused loss kernel vocabulary (argmax lanes are float32)")
    check_int32_addressable(min(chunk, n) * v, f"fused loss kernel logits chunk [{min(chunk, n)}, {v}]")
    check_inputs(x, y, w, latent, w2, labels, coef_ce, coef_l1)
    if w.dtype not in _TORCH_TO_TL:
        raise TypeError(f"lm_loss_tilelang: unsupported LM head dtype {w.dtype}")
    dev = x.device
    kern = _compiled(v, bool(need_grads), _TORCH_TO_TL[w.dtype], target)
    ce = torch.empty(n, device=dev)
    l1 = torch.empty(n, device=dev)
    d_arg = torch.empty(n, device=dev, dtype=torch.int32)
    t_arg = torch.empty(n, device=dev, dtype=torch.int32)
    gx = torch.empty(n, x.shape[1], device=dev) if need_grads else None
    ge = torch.empty(n, latent.shape[1], device=dev) if (need_grads and latent is not None) else None
    gw2 = torch.zeros(w2.shape, device=dev) if (need_grads and latent is not None) else None
    a_all, b_all = coef_ce.float().contiguous(), coef_l1.float().contiguous()
    lab_all = labels.to(torch.int32).contiguous()
    with torch.no_grad():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            e = None if latent is None else latent[lo:hi]
            d = F.linear(x[lo:hi].to(w.dtype), w).float()  # [n, V]
            if e is not None:
                d += F.linear(e.to(w2.dtype), w2).float()
            t = F.linear(y[lo:hi].to(w.dtype), w).float()
            dd = torch.empty(hi - lo if need_grads else 1, v, device=dev, dtype=w.dtype)
            outs = [torch.empty(hi - lo, device=dev), torch.empty(hi - lo, device=dev),
                    torch.empty(hi - lo, device=dev, dtype=torch.int32),
                    torch.empty(hi - lo, device=dev, dtype=torch.int32)]
            kern(d, t, lab_all[lo:hi].contiguous(), a_all[lo:hi].contiguous(), b_all[lo:hi].contiguous(), *outs, dd)
            ce[lo:hi], l1[lo:hi], d_arg[lo:hi], t_arg[lo:hi] = outs
            del d, t
            if need_grads:
                gx[lo:hi] = dd @ w
                if e is not None:
                    ge[lo:hi] = dd.to(w2.dtype) @ w2
                    gw2.addmm_(dd.t().float(), e.float())
            del dd
    return LMLossParts(ce, l1, d_arg.long(), t_arg.long(), gx, ge, gw2)
