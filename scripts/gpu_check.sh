#!/usr/bin/env bash
# GPU checks for a machine with CUDA, in well under 10 minutes; everything lands in ${OUT:-gpu_out}/:
#   pytest_gpu.txt      CUDA-only tests: flex attention, tilelang fused loss + mHC kernels vs the torch
#                       references (forward and backward), a tiny bf16 training run with each ops backend
#   results.jsonl       one JSON line per benchmark row: fused loss (naive eager / torch.compile / chunked
#                       torch / tilelang) at the issue size, mHC pieces (torch / tilelang) vs copy bandwidth
#   bench_*.log, train_gpu.log, metrics_gpu.json, summary.txt
# Usage: bash scripts/gpu_check.sh      (tilelang: pip install -e '.[kernels]')
#
# GPU half for vLLM (issue 17): bash scripts/gpu_check.sh vllm   (needs: pip install vllm==0.33.0)
#   vLLM 0.33.0 serves each tiny export (DeepSeek-V4 DSpark merged, DeepSeek-V4 MTP, HY V4 MTP, dense DSpark,
#   DFlash): greedy outputs vs vLLM's plain greedy, AL from vLLM's spec-decode counters vs eval.py's AL on the
#   same prompts -> $OUT/vllm/results.jsonl + summary.txt (scripts/vllm_serve_check.py). Never run on the
#   development machines (no GPU there); expect tens of minutes (5 short GPU trainings, 10 vLLM engine starts).
#   Then the DeepSeek-V4 feature producer (issue 26, item 4; NOT RUN YET): target features built by vLLM (checkpoint
#   view + the worker-side normed-final capture) vs FrozenTarget's, the uncaptured final as the negative check, a few
#   DSpark V4 steps on a vLLM-built cache -> $OUT/vllm/v4_features/ (scripts/vllm_v4_features_check.py, ~5 engine
#   starts). `bash scripts/gpu_check.sh vllm-v4-features` runs that part alone.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "vllm-v4-features" ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  timeout 1500 python scripts/vllm_v4_features_check.py --out "$OUT/vllm/v4_features" "${@:2}"
  exit $?
fi
if [ "${1:-}" = "vllm" ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  python scripts/vllm_serve_check.py --out "$OUT/vllm" "${@:2}"
  serve_rc=$?
  timeout 1500 python scripts/vllm_v4_features_check.py --out "$OUT/vllm/v4_features"
  v4_rc=$?
  [ "$serve_rc" -eq 0 ] && [ "$v4_rc" -eq 0 ]
  exit $?
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import tilelang; print('tilelang', tilelang.__version__)" > "$OUT/versions.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >> "$OUT/versions.txt" 2>&1

# 1. parity tests (kernels vs references) + the existing CUDA tests, DeepSpeed ZeRO-2/3 and FSDP2 tiny runs
#    (issue 26: DeepSpeed refuses a CPU accelerator; needs pip install -e '.[deepspeed]', else those skip)
timeout 360 python -m pytest -q -m gpu tests/ops/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt"

# 2. fused loss at the issue size: V=129280, N=2560 rows, H=4096, Markov rank 256, bf16 weights
timeout 150 python benchmarks/bench_loss.py --device cuda --dtype bfloat16 --n 2560 --v 129280 --h 4096 --r 256 \
  --chunk 512 --reps 5 --warmup 2 --variants naive compiled chunked tilelang --out "$OUT/results.jsonl" \
  > "$OUT/bench_loss.log" 2>&1

# 3. mHC pieces (V4-Flash: hc 4, H 4096) vs the measured copy bandwidth
timeout 60 python benchmarks/bench_mhc.py --device cuda --tokens 16384 --hc 4 --hidden 4096 --dtype bfloat16 \
  --out "$OUT/results.jsonl" > "$OUT/bench_mhc.log" 2>&1

# 4. the default experiment on the GPU (auto backend: the kernels); worst case of all steps ~9.5 min
timeout 150 python train.py experiment=dspark_v4 trainer=gpu run_dir="$OUT/run_default_gpu" \
  trainer.enable_progress_bar=false > "$OUT/train_gpu.log" 2>&1
cp "$OUT/run_default_gpu/metrics.json" "$OUT/metrics_gpu.json" 2>/dev/null || true

{
  echo "== pytest"; tail -3 "$OUT/pytest_gpu.txt"
  echo "== fused loss"; cat "$OUT/bench_loss.log"
  echo "== mHC"; cat "$OUT/bench_mhc.log"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
echo "done: $OUT"
