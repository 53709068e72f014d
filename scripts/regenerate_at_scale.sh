#!/usr/bin/env bash
# SmolLM2 regeneration at scale through vLLM (benchmarks/README.md, "Data at scale (issue 23)"): 4000 ShareGPT first
# user turns and 1500 reasoning-gym problems, the two sources in alternating stages of growing --limit so both
# files fill from the start. Each stage is scripts/regenerate.py (resumable), so rerunning this script continues
# where it stopped; a stage whose records are all settled (output + failure sidecar) is skipped without starting
# vLLM. Run in the background:
#
#   DSPARK_VLLM_PYTHON=.venv-vllm/bin/python DSPARK_VLLM_THREADS=1 \
#     nohup nice -n 19 bash scripts/regenerate_at_scale.sh > data/regenerated/at_scale.log 2>&1 &
#
# PYTHON: the project's interpreter (default: python). OUT_DIR: default data/regenerated. BATCH_SIZE: records per
# vLLM call (default 64; smaller saves progress more often on a loaded machine). Progress (records in
# the output / limit, records/min, answer tokens/s, ETA) is logged by every stage after each batch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-data/regenerated}
SHAREGPT_OUT=$OUT_DIR/smollm2_sharegpt_5k.jsonl
RG_OUT=$OUT_DIR/smollm2_reasoning_gym_1500.jsonl
mkdir -p "$OUT_DIR"
COMMON=(--target smollm2 --engine vllm --batch-size "${BATCH_SIZE:-64}" --max-new-tokens 192 --temperature 0.7 --top-p 0.95 --seed 0)

settled() {  # records already in the output or its failure sidecar
  cat "$1" "$1.failed.jsonl" 2>/dev/null | wc -l
}

stage() {  # stage SOURCE LIMIT
  local source=$1 limit=$2 out args
  if [ "$source" = sharegpt ]; then
    out=$SHAREGPT_OUT
    args=(--source sharegpt --english-only --max-user-turns 1 --max-prompt-chars 1200)
  else
    out=$RG_OUT
    args=(--source reasoning-gym --rg-seed 0 --max-user-turns 1)
  fi
  if [ "$(settled "$out")" -ge "$limit" ]; then
    echo "[$(date +%FT%T)] stage $source --limit $limit: already settled ($(settled "$out") records), skipped"
    return
  fi
  echo "[$(date +%FT%T)] stage $source --limit $limit -> $out"
  "$PY" scripts/regenerate.py "${args[@]}" "${COMMON[@]}" --out "$out" --limit "$limit"
}

for spec in sharegpt:500 reasoning-gym:300 sharegpt:1500 reasoning-gym:800 sharegpt:2500 reasoning-gym:1500 \
            sharegpt:4000; do
  stage "${spec%%:*}" "${spec##*:}"
done
echo "[$(date +%FT%T)] all stages done: $(settled "$SHAREGPT_OUT") sharegpt, $(settled "$RG_OUT") reasoning-gym records"
