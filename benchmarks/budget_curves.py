#!/usr/bin/env python
"""Learning curves of the 10x-budget runs (benchmarks/smollm2_budget.sh): per draft, the held-out tau_prob and top-1
agreement at every validation, eval.py's AL per benchmark at every quarter of the budget, the ratio to DFlash, and
the training compute spent by each quarter (FLOPs per step x steps); written into the given folder as a markdown
table, its JSON and a plot (curves.*: tau by step, macro AL by quarter, macro AL by training TFLOP).

    python benchmarks/budget_curves.py runs/budget [benchmarks/results/budget_step_flops.json]

FLOPs per step: the run's own count (metrics.json throughput, dspark.training.flops: dense block drafts), else the
optional JSON's {draft: {"flops_per_step": N}} (benchmarks/bench_step_flops.py's count, e.g. for EAGLE-3); a draft with
neither gets no compute column.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")


def validation_curve(run: Path) -> list[dict]:
    """Every logged validation of the run (all logger versions: a resumed run adds one): step, tau_prob, agree_k."""
    by_step: dict[int, dict] = {}
    for f in sorted(run.glob("logs/version_*/metrics.csv")):
        with f.open() as fh:
            for row in csv.DictReader(fh):
                if row.get("val/tau_prob"):
                    agree = [float(row[k]) for k in sorted(row, key=lambda k: (len(k), k))
                             if k.startswith("val/agree_") and row[k]]
                    by_step[int(row["step"])] = {"step": int(row["step"]), "tau_prob": float(row["val/tau_prob"]),
                                                 "agree": agree}
    return [by_step[s] for s in sorted(by_step)]


def quarter_evals(run: Path) -> list[dict]:
    """eval_q1..q4: AL per benchmark, macro AL, per-position cumulative rates (mean over benchmarks), greedy check."""
    out = []
    for k in (1, 2, 3, 4):
        summaries = sorted((run / f"eval_q{k}").glob("summary.T*.json"))
        if not summaries:
            continue
        reports = json.loads(summaries[0].read_text())["reports"]
        al = {b: reports[b]["mean_acceptance_length"] for b in BENCHMARKS if b in reports}
        rates = [reports[b]["per_position_rate"] for b in al]
        out.append({"quarter": k, "al": al, "macro": sum(al.values()) / len(al),
                    "per_position": [sum(r[i] for r in rates) / len(rates) for i in range(len(rates[0]))],
                    "greedy_equal": [reports[b].get("greedy_outputs_equal_target") for b in al]})
    return out


def collect(root: Path, step_flops: dict | None = None) -> dict:
    runs = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir() and (p / "logs").is_dir()):
        metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else {}
        own = ((metrics.get("throughput") or {}).get("flops_per_step") or {}).get("total")
        given = ((step_flops or {}).get(run.name) or {}).get("flops_per_step")
        evals, steps = quarter_evals(run), metrics.get("global_step")
        per_step = own or given
        for e in evals:  # the training compute behind the quarter's checkpoint
            e["train_tflop"] = None if not (per_step and steps) else e["quarter"] * (steps // 4) * per_step / 1e12
        runs[run.name] = {"validation": validation_curve(run), "evals": evals, "flops_per_step": per_step,
                          "throughput": metrics.get("throughput"), "global_step": steps}
    return runs


def markdown(runs: dict) -> str:
    lines = ["| draft | quarter | training TFLOP | AL mt-bench / gsm8k / humaneval | macro AL | / DFlash | cumulative rate "
             "pos 0 / 1 / 2 | greedy == target |", "|---|---|---|---|---|---|---|---|"]
    base = {e["quarter"]: e["macro"] for e in runs.get("dflash", {}).get("evals", [])}
    for name, r in runs.items():
        for e in r["evals"]:
            ratio = base.get(e["quarter"])
            lines.append("| {} | {} | {} | {} | {:.3f} | {} | {} | {} |".format(
                name, e["quarter"], "-" if e["train_tflop"] is None else f"{e['train_tflop']:.0f}",
                " / ".join(f"{e['al'][b]:.3f}" for b in e["al"]), e["macro"],
                "-" if not ratio else f"{e['macro'] / ratio:.3f}",
                " / ".join(f"{v:.3f}" for v in e["per_position"][:3]),
                "-" if None in e["greedy_equal"] else all(e["greedy_equal"])))
    lines += ["", "| draft | step | held-out tau_prob | agreement pos 0 / 1 / 2 |", "|---|---|---|---|"]
    for name, r in runs.items():
        for v in r["validation"]:
            lines.append(f"| {name} | {v['step']} | {v['tau_prob']:.3f} | "
                         + " / ".join(f"{a:.3f}" for a in v["agree"][:3]) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for name, r in runs.items():
        if r["validation"]:
            a.plot([v["step"] for v in r["validation"]], [v["tau_prob"] for v in r["validation"]], marker="o", label=name)
        if r["evals"]:
            b.plot([e["quarter"] for e in r["evals"]], [e["macro"] for e in r["evals"]], marker="s", label=name)
        costed = [e for e in r["evals"] if e["train_tflop"] is not None]
        if costed:
            c.plot([e["train_tflop"] for e in costed], [e["macro"] for e in costed], marker="s", label=name)
    a.set(xlabel="optimizer step", ylabel="held-out tau_prob", title="held-out expected acceptance length")
    b.set(xlabel="quarter of the budget", ylabel="macro AL (eval.py, T=0)", title="measured acceptance length")
    c.set(xlabel="training TFLOP", ylabel="macro AL (eval.py, T=0)", title="measured AL at equal compute")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    runs = collect(root, json.loads(Path(argv[1]).read_text()) if len(argv) > 1 else None)
    (root / "curves.json").write_text(json.dumps(runs, indent=1))
    text = markdown(runs)
    (root / "curves.md").write_text(text)
    print(text)
    try:
        plot(runs, root / "curves.png")
    except ImportError:
        print("matplotlib missing: no curves.png (pip install -e .[plots])")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
