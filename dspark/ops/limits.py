"""Size limits that only real models reach, checked before a kernel runs so they fail loudly instead of
indexing wrong: tilelang kernels address their tensors with int32 offsets, and the fused loss kernel
carries vocabulary indices in float32 lanes (exact only below 2^24)."""
from __future__ import annotations

INT32_MAX = 2**31 - 1
FLOAT32_EXACT_INT = 2**24


def check_int32_addressable(numel: int, what: str) -> None:
    """A kernel operand of `numel` elements must be addressable with int32 offsets."""
    if numel > INT32_MAX:
        raise ValueError(f"{what}: {numel} elements exceed the int32 offsets of the tilelang kernels "
                         f"({INT32_MAX}); use fewer rows per chunk / a smaller micro-batch")


def check_float32_index(n: int, what: str) -> None:
    """Indices 0..n-1 carried in float32 must be exact integers."""
    if n > FLOAT32_EXACT_INT:
        raise ValueError(f"{what}: {n} indices cannot be carried exactly in float32 (limit {FLOAT32_EXACT_INT})")
