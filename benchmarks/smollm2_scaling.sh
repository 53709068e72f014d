#!/usr/bin/env bash
# One point of the SmolLM2 data-scaling comparison (benchmarks/README.md, "SmolLM2 at growing data budgets"):
# DSpark, DFlash and DFlash2 trained on the same N regenerated conversations with the same budget, then measured
# by eval.py (real speculative decoding, vLLM's counting) on MT-Bench / GSM8K / HumanEval.
#
#   bash benchmarks/smollm2_scaling.sh N [STEPS]          # e.g. 500 400; resumable: rerun to continue
#
# Data: scripts/mix_regenerated.py freezes data/regenerated/smollm2_mix_N.jsonl once (3N/4 regenerated ShareGPT +
# N/4 reasoning-gym records, from scripts/regenerate_at_scale.sh; `python scripts/pack_regenerated.py unpack ...`
# restores packed ones).
# Each run: trainer.precision=bf16-mixed where the CPU has bf16 units (AVX512-BF16 / AMX), else fp32.
# Environment: DRAFTS (default "dspark dflash dflash2"), NUM_PROMPTS (default 32), MAX_NEW_TOKENS (default 128),
# EVALS (temperature:draft_sample_method pairs, default "0:greedy"; e.g. "0:greedy 1:greedy 1:probabilistic"), EXTRA (more train.py overrides), EVAL_EXTRA (more eval.py overrides), OUT (default runs/scaling).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash benchmarks/smollm2_scaling.sh N [STEPS]}
STEPS=${2:-400}
PY=${PYTHON:-python}
OUT=${OUT:-runs/scaling}/n$N
SHAREGPT=${SHAREGPT:-data/regenerated/smollm2_sharegpt_5k.jsonl}
RG=${RG:-data/regenerated/smollm2_reasoning_gym_1500.jsonl}
MIX=data/regenerated/smollm2_mix_$N.jsonl

[ -f "$MIX" ] || "$PY" scripts/mix_regenerated.py "$SHAREGPT" "$RG" "$MIX" "$N"

if lscpu 2>/dev/null | grep -qE "avx512_bf16|amx_bf16"; then PRECISION=bf16-mixed; else PRECISION=32-true; fi
for d in ${DRAFTS:-dspark dflash dflash2}; do
  run=$OUT/$d
  if [ ! -f "$run/draft/model.safetensors" ]; then
    resume=()
    [ -f "$run/checkpoints/last.ckpt" ] && resume=(resume=last)
    "$PY" train.py experiment=${d}_smollm2 data.path="$MIX" trainer.max_steps="$STEPS" \
      trainer.val_check_interval=$(( STEPS / 4 )) trainer.precision=$PRECISION trainer.enable_progress_bar=false \
      run_dir="$run" "${resume[@]}" ${EXTRA:-}
  fi
  for spec in ${EVALS:-0:greedy}; do  # temperature:draft_sample_method
    t=${spec%%:*} method=${spec##*:}
    dir=$run/eval_T${t}_$method
    ls "$dir"/summary.T*.json >/dev/null 2>&1 && continue
    "$PY" eval.py run_dir="$run" num_prompts="${NUM_PROMPTS:-32}" max_new_tokens="${MAX_NEW_TOKENS:-128}" \
      temperature="$t" draft_sample_method="$method" plots=false out="$dir" ${EVAL_EXTRA:-}
  done
done
"$PY" benchmarks/scaling_table.py "$OUT"
