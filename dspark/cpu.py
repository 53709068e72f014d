"""What this CPU computes fastest: the dtype (and Lightning precision) chosen from its instruction set.

bf16 GEMMs run on AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`) at 2x-10x fp32; on a CPU with neither (AVX2
only) torch emulates bf16 and a bf16 GEMM is ~28x SLOWER than fp32. Regeneration and training read the choice
from here and say it, with the reason, at the start of a run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" | "float32"
    reason: str  # one clause: which flag decided

    @property
    def precision(self) -> str:
        """The Lightning trainer precision of this choice."""
        return "bf16-mixed" if self.dtype == "bfloat16" else "32-true"


def fast_cpu_dtype(flags: frozenset[str] | None = None) -> DtypeChoice:
    """bfloat16 where the CPU has AMX or AVX512-BF16, float32 otherwise."""
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return DtypeChoice("bfloat16", f"this CPU has {' and '.join(have)} (bf16 GEMMs in hardware)")
    return DtypeChoice("float32", "this CPU has neither amx_bf16 nor avx512_bf16 (bf16 would be emulated, "
                                  "~28x slower than float32)")


def resolve_target_dtype(dtype: str) -> tuple[str, str]:
    """``(dtype, why)`` of the frozen target's weights: ``auto`` -> bfloat16 on a GPU, else this CPU's
    :func:`fast_cpu_dtype`; any other value as given. (The target forward is most of a feature-cache build and of
    eval.py's step: bf16 halves it on a CPU with bf16 hardware.)"""
    if dtype != "auto":
        return dtype, "target.dtype"
    if torch.cuda.is_available():
        return "bfloat16", "a GPU"
    choice = fast_cpu_dtype()
    return choice.dtype, choice.reason
