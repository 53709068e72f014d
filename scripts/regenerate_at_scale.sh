#!/usr/bin/env bash
# The SmolLM2 30k set (benchmarks/README.md, "The 30k SmolLM2 set"): ShareGPT conversations regenerated turn by turn
# (up to 3 user turns, each answered given the target's own earlier answers) and reasoning-gym problems from 40
# families, through the native CPU engine (scripts/regenerate.py's default). The two sources fill in alternating
# stages of growing --limit; each stage is scripts/regenerate.py (resumable), so rerunning this script continues
# where it stopped; a stage whose records are all settled (output + failure sidecar) is skipped. Run in the
# background on one core, packing progress as it comes (scripts/pack_regenerated.py shard):
#
#   OMP_NUM_THREADS=1 nohup nice -n 10 bash scripts/regenerate_at_scale.sh > data/regenerated/at_scale.log 2>&1 &
#
# PYTHON: the project's interpreter (default: python). OUT_DIR: default data/regenerated. ROWS: rows decoded
# together (default 128).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-data/regenerated}
SHAREGPT_OUT=$OUT_DIR/smollm2_30k_sharegpt.jsonl
RG_OUT=$OUT_DIR/smollm2_30k_reasoning_gym.jsonl
mkdir -p "$OUT_DIR"
COMMON=(--target smollm2 --batch-size "${ROWS:-128}" --max-new-tokens 192 --temperature 0.7 --top-p 0.95 --seed 0
        --max-model-len 1536 --progress-every 50)

settled() {  # records already in the output or its failure sidecar
  cat "$1" "$1.failed.jsonl" 2>/dev/null | wc -l
}

stage() {  # stage SOURCE LIMIT
  local source=$1 limit=$2 out args
  if [ "$source" = sharegpt ]; then
    out=$SHAREGPT_OUT
    args=(--source sharegpt --english-only --max-user-turns 3 --max-prompt-chars 2000)
  else
    out=$RG_OUT
    args=(--source reasoning-gym --rg-seed 1 --rg-tasks wide --max-user-turns 1)
  fi
  if [ "$(settled "$out")" -ge "$limit" ]; then
    echo "[$(date +%FT%T)] stage $source --limit $limit: already settled ($(settled "$out") records), skipped"
    return
  fi
  echo "[$(date +%FT%T)] stage $source --limit $limit -> $out"
  "$PY" scripts/regenerate.py "${args[@]}" "${COMMON[@]}" --out "$out" --limit "$limit"
}

# ShareGPT holds 13,866 such conversations (after the prompt filter); reasoning-gym fills the set to 30,000. The
# stages reach the 15,000 of the data-size curve early (scripts/mix_regenerated.py --rg-share 27/50: 6,900 ShareGPT +
# 8,100 reasoning-gym), then the whole set (13,800 + 16,200 at the same share); reasoning-gym (~93 conversations/min
# on one core, ShareGPT's multi-turn ~34) goes first so the count grows fastest; the last 800 reasoning-gym problems
# took the set past 30,000 while ShareGPT's last ranges were still running (session 5).
for spec in sharegpt:2000 reasoning-gym:2000 sharegpt:5000 reasoning-gym:5000 sharegpt:7000 reasoning-gym:8100 \
            sharegpt:9000 reasoning-gym:16200 sharegpt:13866 reasoning-gym:17000; do
  stage "${spec%%:*}" "${spec##*:}"
done
echo "[$(date +%FT%T)] all stages done: $(settled "$SHAREGPT_OUT") sharegpt, $(settled "$RG_OUT") reasoning-gym records"
