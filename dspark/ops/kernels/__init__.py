"""tilelang kernels for the fused ops (dspark.ops.backend picks them on CUDA).

`compile_for_arch` lowers a kernel and compiles its CUDA source to a cubin with the machine's nvcc for
a given architecture, without a GPU: what CI checks (tests/ops/test_kernel_compile.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME/bin, PATH, or /usr/local/cuda/bin (None when absent)."""
    for cand in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def lower_for_arch(func, arch: str = "sm_90a") -> str:
    """Lower a tilelang prim_func for CUDA `arch` (no device needed) -> the generated CUDA source."""
    import tilelang
    from tilelang import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with target:
        artifact = tilelang.lower(func, target=target)
    return artifact.kernel_source


def compile_for_arch(func, arch: str = "sm_90a", nvcc: str | None = None, workdir: str | None = None) -> bytes:
    """Lower `func` and compile it to a cubin for `arch` with nvcc, using tilelang's own include paths and
    flags. Returns the cubin bytes; raises RuntimeError with nvcc's output on failure."""
    from tilelang import env

    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    src = lower_for_arch(func, arch)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        cu, cubin = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        cu.write_text(src)
        cmd = [nvcc, "--cubin", "-O3", f"-arch={arch}", "-std=c++20", "-w",
               "-I" + env.TILELANG_TEMPLATE_PATH, "-I" + env.CUTLASS_INCLUDE_DIR, "-o", str(cubin), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not cubin.is_file():
            raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        return cubin.read_bytes()
