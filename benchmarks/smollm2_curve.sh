#!/usr/bin/env bash
# The data-size curve of the drafts worth serving (issue 48 item 3; benchmarks/README.md, "The data-size curve"): the
# 10x recipe (benchmarks/smollm2_budget.sh: 16k draft vocabulary, 32 anchors, rank-256 Markov head for DSpark, a
# checkpoint and an eval.py measurement at every quarter) on the first N conversations of the 30k SmolLM2 set, mixed
# at the whole set's reasoning-gym share (scripts/mix_regenerated.py ... 27/50: a smaller N's mix is the larger's
# prefix), the same number of steps at every N.
#
#   bash benchmarks/smollm2_curve.sh N [STEPS]      # e.g. 9000, 15000, 30000; STEPS default 2000; resumable
#
# Environment: DRAFTS (default "dspark dflash eagle3", one after the other: one run per core), OUT (default
# runs/curve), PHASE (all | train | eval, as smollm2_budget.sh), PYTHON. The N = 4,696 point is the 10x budget's own
# (benchmarks/smollm2_budget.sh on the older 3:1 mix). Needs the set's records: `python scripts/pack_regenerated.py
# unpack smollm2_30k_sharegpt` and `... smollm2_30k_reasoning_gym` (and scripts/regenerate_at_scale.sh for more).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash benchmarks/smollm2_curve.sh N [STEPS]}
STEPS=${2:-2000}
PY=${PYTHON:-python}
MIX=data/regenerated/smollm2_mix54_$N.jsonl
[ -f "$MIX" ] || "$PY" scripts/mix_regenerated.py data/regenerated/smollm2_30k_sharegpt.jsonl \
  data/regenerated/smollm2_30k_reasoning_gym.jsonl "$MIX" "$N" 27/50
for d in ${DRAFTS:-dspark dflash eagle3}; do
  DATA=$MIX OUT=${OUT:-runs/curve}/n$N bash benchmarks/smollm2_budget.sh "$d" "$STEPS"
done
