#!/usr/bin/env bash
# Warm vs cold start on SmolLM2-135M-Instruct (benchmarks/README.md, "Warm start from DFlash"): a DSpark draft trained
# STEPS steps from scratch and the same draft started from the 10x-budget DFlash draft (draft.init_from: backbone
# copied, Markov and confidence heads fresh), same data, recipe and seed; held-out tau_prob at every quarter, then
# eval.py on both (T = 0, gamma 6).
#
#   bash benchmarks/smollm2_warm_start.sh [STEPS]        # default 500; needs runs/budget/dflash (benchmarks/smollm2_budget.sh)
#
# Resumable: rerun the same command. Environment: OUT (default runs/warm), SOURCE (default runs/budget/dflash/draft),
# NUM_PROMPTS (16), MAX_NEW_TOKENS (128), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-500}
PY=${PYTHON:-python}
OUT=${OUT:-runs/warm}
SOURCE=${SOURCE:-runs/budget/dflash/draft}
DATA=data/regenerated/smollm2_mix_4696.jsonl
[ -f "$SOURCE/model.safetensors" ] || { echo "no trained DFlash draft at $SOURCE: run benchmarks/smollm2_budget.sh dflash first"; exit 2; }
if lscpu 2>/dev/null | grep -qE "avx512_bf16|amx_bf16"; then PRECISION=bf16-mixed; else PRECISION=32-true; fi
for start in cold warm; do
  RUN=$OUT/dspark_$start
  init=()
  [ "$start" = warm ] && init=(draft.init_from="$SOURCE")
  if [ ! -f "$RUN/draft/model.safetensors" ]; then
    resume=()
    [ -e "$RUN/checkpoints/last.ckpt" ] && resume=(resume=last)
    "$PY" train.py experiment=dspark_smollm2 data.path="$DATA" trainer.max_steps="$STEPS" \
      trainer.val_check_interval=$(( STEPS / 4 )) trainer.precision=$PRECISION trainer.enable_progress_bar=false \
      train.num_anchors=32 draft.draft_vocab_size=16384 draft.markov_rank=256 "${init[@]}" run_dir="$RUN" \
      validate_at_start=true "${resume[@]}"
  fi
  ls "$RUN"/eval/summary.T*.json >/dev/null 2>&1 || "$PY" eval.py run_dir="$RUN" num_prompts="${NUM_PROMPTS:-16}" \
    max_new_tokens="${MAX_NEW_TOKENS:-128}" plots=false out="$RUN/eval"
done
