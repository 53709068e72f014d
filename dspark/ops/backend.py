"""One dispatch point for the fused ops (fused DSpark loss, mHC): `ops_backend` = auto | torch | tilelang.

  torch    : the torch references (chunked loss, mHC with recompute-in-backward) on every device.
  tilelang : the tilelang kernels; an error when a tensor is not on CUDA or tilelang is missing.
  auto     : tilelang kernels for CUDA tensors when tilelang imports, the torch references otherwise.

The setting is process-wide (set once from the run config by the factory: key `ops_backend`); every op
asks `resolve(tensor)` which implementation to run for its inputs.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

OPS_BACKENDS = ("auto", "torch", "tilelang")

_backend = "auto"


def set_ops_backend(name: str) -> None:
    """Select the backend for every fused op in this process (config key `ops_backend`)."""
    global _backend
    if name not in OPS_BACKENDS:
        raise ValueError(f"ops_backend must be one of {OPS_BACKENDS}, got {name!r}")
    _backend = name


def get_ops_backend() -> str:
    return _backend


@functools.lru_cache(maxsize=1)
def tilelang_available() -> bool:
    """True when the tilelang package can be found (it is only imported when a kernel is built)."""
    try:
        return importlib.util.find_spec("tilelang") is not None
    except (ImportError, ValueError):
        return False


def resolve(x: torch.Tensor, backend: str | None = None) -> str:
    """'torch' or 'tilelang' for an op whose main input is `x` (backend=None: the process setting)."""
    name = _backend if backend is None else backend
    if name not in OPS_BACKENDS:
        raise ValueError(f"ops_backend must be one of {OPS_BACKENDS}, got {name!r}")
    if name == "torch":
        return "torch"
    if name == "tilelang":
        if not x.is_cuda:
            raise RuntimeError(f"ops_backend=tilelang needs CUDA tensors, got a tensor on {x.device}; "
                               "use ops_backend=auto or torch on CPU")
        if not tilelang_available():
            raise RuntimeError("ops_backend=tilelang but the tilelang package is not installed "
                               "(pip install -e '.[kernels]')")
        return "tilelang"
    return "tilelang" if (x.is_cuda and tilelang_available()) else "torch"
