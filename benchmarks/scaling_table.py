#!/usr/bin/env python
"""The table of one scaling point (benchmarks/smollm2_scaling.sh): per draft and temperature, eval.py's mean acceptance
length (AL, incl. the bonus token) per benchmark, the macro mean, the ratio to DFlash, and the run's held-out
tau_prob, steps and wall time (metrics.json), as markdown.

    python benchmarks/scaling_table.py runs/scaling/n500 [more point folders ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")


def point_rows(point: Path) -> list[dict]:
    rows = []
    for run in sorted(p for p in point.iterdir() if (p / "metrics.json").is_file()):
        metrics = json.loads((run / "metrics.json").read_text())
        for ev in sorted(run.glob("eval_T*")):
            for summary in sorted(ev.glob("summary.T*.json")):
                reports = json.loads(summary.read_text())["reports"]
                al = {b: reports[b]["mean_acceptance_length"] for b in BENCHMARKS if b in reports}
                rows.append(dict(point=point.name, draft=run.name, tag=ev.name.removeprefix("eval_"),
                                 al=al, macro=sum(al.values()) / len(al),
                                 equal=[reports[b].get("greedy_outputs_equal_target") for b in al],
                                 tau=metrics.get("final", {}).get("val/tau_prob"),
                                 steps=metrics.get("global_step"),
                                 s_per_step=(metrics.get("throughput") or {}).get("s_per_step")))
    return rows


def markdown(rows: list[dict]) -> str:
    base = {(r["point"], r["tag"]): r["macro"] for r in rows if r["draft"] == "dflash"}
    out = ["| data | draft | eval | AL mt-bench / gsm8k / humaneval | macro AL | / DFlash | held-out tau_prob | steps |"
           " s/step | greedy == target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = base.get((r["point"], r["tag"]))
        out.append("| {} | {} | {} | {} | {:.3f} | {} | {} | {} | {} | {} |".format(
            r["point"], r["draft"], r["tag"], " / ".join(f"{v:.3f}" for v in r["al"].values()), r["macro"],
            f"{r['macro'] / ratio:.3f}" if ratio else "-", f"{r['tau']:.3f}" if r["tau"] else "-", r["steps"], r["s_per_step"],
            ", ".join(str(e) for e in r["equal"] if e) or "-"))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(markdown([r for p in sys.argv[1:] for r in point_rows(Path(p))]))
