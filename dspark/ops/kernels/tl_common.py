"""Helpers shared by the tilelang kernels: one kernel source for two targets.

`cpu=True` builds the same kernel for tilelang's C backend, which runs on the CPU: register fragments
become local buffers and the tile reductions become serial loops (the C backend has neither). The
tests run those CPU builds against the torch references, so the kernels' indexing, guards and formulas
are checked on a machine without a GPU; the CUDA build differs only in the fragment layouts and
reductions, which tilelang provides.
"""
# No `from __future__ import annotations`: tilelang reads annotations as live objects.

import tilelang.language as T


@T.macro
def _sum_cpu(src, dst, a_len, b_len):
    for a in T.serial(a_len):
        dst[a] = 0.0
        for b in T.serial(b_len):
            dst[a] += src[a, b]


# dst[a] = pick over b of src[a, b]; pick is T.max or T.min
@T.macro
def _extreme_cpu(src, dst, a_len, b_len, pick):
    for a in T.serial(a_len):
        dst[a] = src[a, 0]
        for b in T.serial(b_len):
            dst[a] = pick(dst[a], src[a, b])


@T.macro
def _sum3_cpu(src, dst, a_len, b_len, c_len):
    for a in T.serial(a_len):
        for b in T.serial(b_len):
            dst[a, b] = 0.0
            for c in T.serial(c_len):
                dst[a, b] += src[a, b, c]


@T.macro
def _zero1(buf, a_len):
    for a in T.serial(a_len):
        buf[a] = 0.0


@T.macro
def _zero2(buf, a_len, b_len):
    for a in T.serial(a_len):
        for b in T.serial(b_len):
            buf[a, b] = 0.0


@T.macro
def _zero3(buf, a_len, b_len, c_len):
    for a in T.serial(a_len):
        for b in T.serial(b_len):
            for c in T.serial(c_len):
                buf[a, b, c] = 0.0


def alloc_frag(shape, dtype, cpu: bool):
    """A register fragment on CUDA; for the C backend (no fragments, and T.Parallel may not index local
    buffers) a block-scope buffer."""
    return T.alloc_shared(shape, dtype, scope="shared") if cpu else T.alloc_fragment(shape, dtype)


def alloc_smem(shape, dtype, cpu: bool):
    """Shared memory (dynamic on CUDA; static for the C backend, which allows one dynamic buffer only)."""
    return T.alloc_shared(shape, dtype, scope="shared") if cpu else T.alloc_shared(shape, dtype)


def clear(buf, cpu: bool):
    """T.clear, or explicit zeroing loops for the C backend (its fill handles local/global only)."""
    if not cpu:
        T.clear(buf)
    else:
        {1: _zero1, 2: _zero2, 3: _zero3}[len(buf.shape)](buf, *buf.shape)


def reduce_last(kind: str, src, dst, cpu: bool):
    """dst = reduce(src) over its last axis (src 2-D or, for 'sum', 3-D)."""
    if not cpu:
        getattr(T, f"reduce_{kind}")(src, dst, dim=len(src.shape) - 1)
    elif len(src.shape) == 3:
        if kind != "sum":
            raise ValueError("3-D CPU reductions: sum only")
        _sum3_cpu(src, dst, src.shape[0], src.shape[1], src.shape[2])
    elif kind == "sum":
        _sum_cpu(src, dst, src.shape[0], src.shape[1])
    else:
        _extreme_cpu(src, dst, src.shape[0], src.shape[1], {"max": T.max, "min": T.min}[kind])


def fexp(x, cpu: bool):
    """exp of an fp32 expression (the C backend has no lowering rule for the exp intrinsic)."""
    return T.call_extern("float32", "expf", x) if cpu else T.exp(x)


def flog(x, cpu: bool):
    return T.call_extern("float32", "logf", x) if cpu else T.log(x)


def fabs(x, cpu: bool):
    return T.call_extern("float32", "fabsf", x) if cpu else T.abs(x)
