#!/usr/bin/env python
"""Where the DSpark / DFlash acceptance gap comes from, per draft position (issue 23 item 4).

eval.py's reports carry the per-position CONDITIONAL acceptance rate c_k (accepted at position k given positions
0..k-1 were accepted). Mean acceptance length is then AL = 1 + sum_k prod_{j<=k} c_j (exact for eval.py's counters:
every verify step drafts gamma tokens). This script reads two eval folders (a DFlash baseline and a DSpark run) and
prints, per benchmark: both drafts' c_k, their AL, and the AL of the mixed chain with DSpark's c_0 and the
baseline's c_1.. ("position 0 only"), so the gap splits into what the first draft position contributes and what the
later positions (where the Markov head conditions on the previous draft token) add on top. The later positions'
contribution is multiplied by c_0: with c_0 near 0.25 a later-position gain moves AL four times less than at c_0 = 1.

    python benchmarks/acceptance_decomposition.py runs/scaling/n1500/dflash/eval_T0_greedy runs/scaling/n1500/dspark/eval_T0_greedy
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.evaluation.metrics import acceptance_length_from_conditional as chain_al  # noqa: E402

BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")


def rates(eval_dir: Path) -> dict[str, list[float]]:
    """benchmark -> conditional acceptance rate per draft position (None -> 0: never reached)."""
    summary = next(Path(eval_dir).glob("summary.T*.json"))
    reports = json.loads(summary.read_text())["reports"]
    return {b: [float(c or 0.0) for c in reports[b]["per_position_conditional_rate"]] for b in BENCHMARKS
            if b in reports}


def rows(base: dict[str, list[float]], new: dict[str, list[float]]) -> list[dict]:
    out = []
    for b in base:
        if b not in new:
            continue
        mixed = [new[b][0]] + base[b][1:]
        a0, a1, am = chain_al(base[b]), chain_al(new[b]), chain_al(mixed)
        gap = a1 - a0
        out.append(dict(benchmark=b, c_base=base[b], c_new=new[b], al_base=a0, al_new=a1, al_pos0=am,
                        share_pos0=(am - a0) / gap if gap else float("nan")))
    return out


def markdown(rs: list[dict]) -> str:
    fmt = lambda c: " / ".join(f"{x:.3f}" for x in c[:4])  # noqa: E731 (positions >= 4 are ~0 here)
    lines = ["| benchmark | c_0..c_3 baseline | c_0..c_3 DSpark | AL baseline | AL DSpark c_0 only | AL DSpark | ratio | "
             "share of the gap from position 0 |", "|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['benchmark']} | {fmt(r['c_base'])} | {fmt(r['c_new'])} | {r['al_base']:.3f} | "
                     f"{r['al_pos0']:.3f} | {r['al_new']:.3f} | {r['al_new'] / r['al_base']:.3f} | "
                     f"{r['share_pos0']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(markdown(rows(rates(Path(sys.argv[1])), rates(Path(sys.argv[2])))))
