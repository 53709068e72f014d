#!/usr/bin/env bash
# The 10x training budget on SmolLM2-135M-Instruct (benchmarks/README.md, "The 10x budget"): one draft trained with the
# learning-per-second recipe on the N = 4,696 regenerated conversations, a checkpoint at every quarter of the budget,
# each quarter measured by eval.py (MT-Bench / GSM8K / HumanEval, T = 0, gamma = block size), then the curve table.
#
#   bash benchmarks/smollm2_budget.sh dspark [STEPS]      # dspark | dflash | dflash2 | eagle3 | xpress; STEPS default 2000
#
# Budget: today's 400 steps x 8 sequences x 16 anchors = 51,200 blocks; STEPS = 2000 with 32 anchors = 512,000
# blocks (10x). Resumable at every stage: rerun the same command (a killed training resumes from its last.ckpt, the
# evals already written are kept). Environment: OUT (default runs/budget), NUM_PROMPTS (16, the table's: the first 16
# conversations of each benchmark, MT-Bench both turns), MAX_NEW_TOKENS (128),
# DATA (the mix jsonl), EXTRA (more train.py overrides), EVAL_EXTRA (more eval.py overrides), PHASE (all | train |
# eval: the training alone, or the evals of a finished training; default all).
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFT=${1:?usage: bash benchmarks/smollm2_budget.sh dspark|dflash|dflash2|eagle3|xpress [STEPS]}
STEPS=${2:-2000}
PY=${PYTHON:-python}
RUN=${OUT:-runs/budget}/$DRAFT
DATA=${DATA:-data/regenerated/smollm2_mix_4696.jsonl}
[ -f "$DATA" ] || "$PY" scripts/mix_regenerated.py data/regenerated/smollm2_sharegpt_5k.jsonl \
  data/regenerated/smollm2_reasoning_gym_1500.jsonl "$DATA" 4696
Q=$(( STEPS / 4 ))
if lscpu 2>/dev/null | grep -qE "avx512_bf16|amx_bf16"; then PRECISION=bf16-mixed; else PRECISION=32-true; fi
case "$DRAFT" in
  dspark) RECIPE=(draft.markov_rank=256 train.num_anchors=32) ;;   # the ablation grid's best head (benchmarks/README.md)
  # EAGLE-3: drafts k = 6 as the block drafts do, so training-time test 6 deep; 2 sequences a step score about the
  # block drafts' loss rows per step (6 x ~190 assistant tokens vs their 32 anchors x 6 positions minus the masked)
  eagle3) RECIPE=(draft.num_steps=6 train.batch_size=2) ;;
  xpress) RECIPE=(train.num_anchors=32) VOCAB=null ;;   # vLLM's XPress needs the whole vocabulary
  *) RECIPE=(train.num_anchors=32) ;;
esac
PHASE=${PHASE:-all}
if [ "$PHASE" != eval ] && [ ! -f "$RUN/draft/model.safetensors" ]; then
  resume=()
  [ -e "$RUN/checkpoints/last.ckpt" ] && resume=(resume=last)
  "$PY" train.py experiment="${DRAFT}_smollm2" data.path="$DATA" trainer.max_steps="$STEPS" \
    trainer.val_check_interval=$(( STEPS / 8 )) trainer.precision=$PRECISION trainer.enable_progress_bar=false \
    draft.draft_vocab_size=${VOCAB:-16384} "${RECIPE[@]}" \
    callbacks.last_checkpoint.every_n_train_steps=$Q callbacks.last_checkpoint.save_top_k=-1 \
    run_dir="$RUN" "${resume[@]}" ${EXTRA:-}
fi
[ "$PHASE" = train ] && exit 0
for k in 1 2 3 4; do
  step=$(( k * Q ))
  dir=$RUN/eval_q$k
  ls "$dir"/summary.T*.json >/dev/null 2>&1 && continue
  ckpt=$(printf "%s/checkpoints/step%07d.ckpt" "$RUN" "$step")
  src=(draft_ckpt="$ckpt")
  compare=false
  [ "$k" = 4 ] && { src=(run_dir="$RUN"); compare=true; }   # the final draft, checked == plain greedy decoding
  "$PY" eval.py target=smollm2 "${src[@]}" num_prompts="${NUM_PROMPTS:-16}" max_new_tokens="${MAX_NEW_TOKENS:-128}" \
    compare_target=$compare plots=false out="$dir" ${EVAL_EXTRA:-}
done
# the compute behind each quarter: the runs' own FLOP counts, EAGLE-3's from benchmarks/bench_step_flops.py
"$PY" benchmarks/budget_curves.py "${OUT:-runs/budget}" benchmarks/results/budget_step_flops.json
