#!/usr/bin/env bash
# vLLM in the loop on a CUDA machine (vllm 0.33.0): what the CPU build cannot serve. Self-contained; everything
# lands in ${OUT:-gpu_out}/vllm/:
#   versions.txt        vLLM / torch / transformers of the vLLM venv, nvidia-smi
#   pytest_vllm.txt     tests/serving/test_vllm_parity.py (DFlash parity step by step, broken exports, regeneration)
#   matrix/             scripts/vllm_matrix.py: dflash, dense dspark, DeepSeek-V4 DSpark, DeepSeek-V4 MTP, EAGLE-3, XPress and
#                       HY V4 MTP drafts trained briefly, exported, load-audited with vLLM's CUDA classes and served
#                       next to eval.py (results.jsonl, summary.txt, one serve_check report per kind)
# Needs: the project venv active (scripts/setup_env.sh) and vLLM 0.33 in .venv-vllm (`bash scripts/setup_vllm.sh gpu`,
# needs the network; or DSPARK_VLLM_PYTHON pointing at a python with vllm 0.33). Budget: < 10 min on one H100/H200.
set -uo pipefail
OUT=${OUT:-gpu_out}/vllm
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi > "$OUT/versions.txt" 2>&1
python -m dspark.serving.engine >> "$OUT/versions.txt" 2>&1 || { cat "$OUT/versions.txt"; exit 2; }
export DSPARK_VLLM_THREADS=${DSPARK_VLLM_THREADS:-4}

# 1. the CI parity test, now with vLLM's CUDA runner (~2 min)
timeout 240 python -m pytest -q -p no:cacheprovider tests/serving/test_vllm_parity.py 2>&1 | tee "$OUT/pytest_vllm.txt"

# 2. every draft kind (~6 min: short CPU training runs + one vLLM engine per kind)
timeout 420 python scripts/vllm_matrix.py --out "$OUT/matrix" > "$OUT/matrix.log" 2>&1

{
  echo "== versions"; tail -1 "$OUT/versions.txt"
  echo "== pytest (vLLM parity)"; tail -3 "$OUT/pytest_vllm.txt"
  echo "== draft kinds"; cat "$OUT/matrix/summary.txt" 2>/dev/null || tail -20 "$OUT/matrix.log"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
echo "done: $OUT"
