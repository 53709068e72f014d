"""Load eval reports of several runs and line them up (used by notebooks/eval_reports.ipynb).

A report folder is what eval.py writes (<out>/summary.T<T>.g<gamma>.json + per-benchmark files); a run
dir is accepted too (its eval/ folder). Rows are (run label, T, gamma, benchmark) with the headline numbers.
"""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("run", "temperature", "gamma", "benchmark", "mean_acceptance_length", "draft_acceptance_rate",
           "speedup_vs_target", "overhead_share", "num_requests")


def summaries(path: str | Path) -> list[Path]:
    p = Path(path)
    if (p / "eval").is_dir() and not list(p.glob("summary.*.json")):
        p = p / "eval"
    found = sorted(p.glob("summary.*.json"))
    if not found:
        raise FileNotFoundError(f"no eval summary (summary.T*.g*.json) in {str(p)!r}")
    return found


def load_rows(runs: dict[str, str | Path]) -> list[dict]:
    """runs: label -> report folder or run dir. One row per (run, summary file, benchmark)."""
    rows = []
    for label, path in runs.items():
        for f in summaries(path):
            for name, r in json.loads(f.read_text())["reports"].items():
                rows.append({
                    "run": label, "temperature": r["temperature"], "gamma": r["gamma"], "benchmark": name,
                    "mean_acceptance_length": r["mean_acceptance_length"],
                    "draft_acceptance_rate": r["draft_acceptance_rate"],
                    "speedup_vs_target": r.get("speedup_vs_target"),
                    "overhead_share": (r.get("harness") or {}).get("overhead_share"),
                    "num_requests": r.get("num_requests", r.get("num_prompts")),
                    "conditional": r["per_position_conditional_rate"],
                })
    return rows


def table(rows: list[dict]) -> str:
    """Plain-text table of the headline columns (numbers to 3 decimals)."""
    def cell(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    body = [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
