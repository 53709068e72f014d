#!/usr/bin/env bash
# DSpark ablations at one data size of the SmolLM2 scaling comparison (issue 23 item 4; benchmarks/README.md,
# "SmolLM2 at growing data budgets"): each variant is experiment=dspark_smollm2 with ONE change, trained on the
# same frozen data mix and budget as `bash benchmarks/smollm2_scaling.sh N STEPS` (run that first: it freezes
# data/regenerated/smollm2_mix_N.jsonl and builds the feature cache every variant then hits), then measured by
# eval.py exactly as the scaling rows (T = 0, gamma 6, NUM_PROMPTS conversations per benchmark). Resumable: rerun
# to continue; a finished variant is skipped.
#
#   bash benchmarks/smollm2_ablations.sh N [STEPS]                      # every variant below
#   VARIANTS="ce_only no_markov" bash benchmarks/smollm2_ablations.sh 1500 400
#   python benchmarks/scaling_table.py runs/ablations/n1500             # the table (base row: runs/scaling/nN/dspark)
#   EVAL_EXTRA=compare_target=false ...   # more eval.py overrides (this one skips the plain-target decode: the
#                                         # variants share DSpark's inference path, whose T = 0 exactness the base row checks)
#
# Variants (the override each makes to the DSpark recipe: loss 0.1 CE + 0.9 L1 + 1.0 conf, Markov rank 64, decay
# gamma 4, 16 anchors per sequence):
#   no_markov    DFlash's draft (markov_rank 0, mask layout: no Markov, no confidence head) with DSpark's loss
#                (0.1 CE + 0.9 L1): between DFlash (CE only) and DSpark, it splits the gap into loss and Markov head
#   rank16       draft.markov_rank=16          rank256   draft.markov_rank=256
#   ce_only      loss 1.0 CE + 0 L1 (+ conf)   l1_only   loss 0 CE + 1.0 L1 (+ conf)
#   no_conf      confidence loss weight 0 (the head is not trained; AL at fixed gamma does not read it)
#   gamma2 / gamma8    train.decay_gamma=2 / 8
#   anchors8 / anchors32    train.num_anchors=8 / 32
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash benchmarks/smollm2_ablations.sh N [STEPS]}
STEPS=${2:-400}
PY=${PYTHON:-python}
OUT=${OUT:-runs/ablations}/n$N
MIX=data/regenerated/smollm2_mix_$N.jsonl
[ -f "$MIX" ] || { echo "$MIX missing: run bash benchmarks/smollm2_scaling.sh $N $STEPS first (it freezes the mix)"; exit 2; }

overrides() {
  case "$1" in
    no_markov) echo "draft.markov_rank=0 draft.layout=mask train.loss_weights.conf=0.0" ;;
    rank16) echo "draft.markov_rank=16" ;;
    rank256) echo "draft.markov_rank=256" ;;
    ce_only) echo "train.loss_weights.ce=1.0 train.loss_weights.l1=0.0" ;;
    l1_only) echo "train.loss_weights.ce=0.0 train.loss_weights.l1=1.0" ;;
    no_conf) echo "train.loss_weights.conf=0.0" ;;
    gamma2) echo "train.decay_gamma=2.0" ;;
    gamma8) echo "train.decay_gamma=8.0" ;;
    anchors8) echo "train.num_anchors=8" ;;
    anchors32) echo "train.num_anchors=32" ;;
    *) echo "unknown variant $1" >&2; return 2 ;;
  esac
}

if lscpu 2>/dev/null | grep -qE "avx512_bf16|amx_bf16"; then PRECISION=bf16-mixed; else PRECISION=32-true; fi
for v in ${VARIANTS:-no_markov ce_only no_conf rank16 gamma8 anchors32 l1_only rank256 gamma2 anchors8}; do
  extra=$(overrides "$v")
  run=$OUT/$v
  if [ ! -f "$run/draft/model.safetensors" ]; then
    resume=()
    [ -f "$run/checkpoints/last.ckpt" ] && resume=(resume=last)
    # shellcheck disable=SC2086
    "$PY" train.py experiment=dspark_smollm2 data.path="$MIX" trainer.max_steps="$STEPS" \
      trainer.val_check_interval=$(( STEPS / 4 )) trainer.precision=$PRECISION trainer.enable_progress_bar=false \
      run_dir="$run" "${resume[@]}" $extra
  fi
  dir=$run/eval_T0_greedy
  ls "$dir"/summary.T*.json >/dev/null 2>&1 && continue
  "$PY" eval.py run_dir="$run" num_prompts="${NUM_PROMPTS:-32}" max_new_tokens="${MAX_NEW_TOKENS:-128}" \
    temperature=0 draft_sample_method=greedy plots=false out="$dir" ${EVAL_EXTRA:-}
done
"$PY" benchmarks/scaling_table.py "$OUT"
