#!/usr/bin/env bash
# GPU checks for a machine with CUDA: the CUDA-only tests plus a short bf16 benchmark of the default
# experiment, results under ${OUT:-gpu_out}/. Usage: bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt"
python train.py experiment=dspark_v4 trainer=gpu run_dir="$OUT/run_default_gpu" trainer.enable_progress_bar=false \
  > "$OUT/train_gpu.log" 2>&1
cp "$OUT/run_default_gpu/metrics.json" "$OUT/metrics_gpu.json" 2>/dev/null || true
echo "done: $OUT"
