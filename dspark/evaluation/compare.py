"""Load eval reports of several runs and line them up (used by notebooks/eval_reports.ipynb).

A report folder is what eval.py writes (<out>/summary.T<T>.g<gamma>.json + per-benchmark files); a run
dir is accepted too (its eval/ folder). Rows are (run label, T, gamma, benchmark) with the headline numbers.
The notebooks find runs through repo_root / newest_run / eval_runs (paths against the checkout, not the kernel's
working directory; $DSPARK_RUNS moves the runs folder).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

def repo_root(start: str | Path | None = None) -> Path:
    """The checkout the notebooks belong to: the nearest folder at or above `start` (default: the working
    directory, which for a notebook kernel is notebooks/) holding train.py and configs/; else the folder above
    the dspark package."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "train.py").is_file() and (d / "configs").is_dir():
            return d
    return Path(__file__).resolve().parents[2]


def runs_root() -> Path:
    """Where `python train.py` writes runs: $DSPARK_RUNS, else <repo>/runs."""
    env = os.environ.get("DSPARK_RUNS")
    return Path(env).expanduser().resolve() if env else repo_root() / "runs"


def default_experiment() -> str:
    """The experiment `python train.py` runs without an override: configs/config.yaml's experiment_name."""
    from omegaconf import OmegaConf

    return str(OmegaConf.load(repo_root() / "configs" / "config.yaml").experiment_name)


def newest_run(experiment: str | None = None, root: str | Path | None = None) -> Path:
    """The most recently finished run (metrics.json written last) of `experiment` (default: default_experiment())
    under the runs folder."""
    experiment = experiment or default_experiment()
    parent = Path(root) if root is not None else runs_root()
    done = sorted((parent / experiment).glob("*/metrics.json"), key=lambda f: f.stat().st_mtime)
    if not done:
        raise FileNotFoundError(f"no finished run under {parent / experiment} (each has metrics.json): run "
                                f"`python train.py experiment={experiment}` from {repo_root()} first")
    return done[-1].parent


def eval_runs(root: str | Path | None = None) -> dict[str, Path]:
    """'<experiment>/<run>' -> run dir, for every run under the runs folder with eval reports, oldest first."""
    parent = Path(root) if root is not None else runs_root()
    found = sorted(parent.glob("*/*/eval/summary.*.json"), key=lambda f: f.stat().st_mtime)
    runs = {f"{f.parents[2].name}/{f.parents[1].name}": f.parents[1] for f in found}
    if not runs:
        raise FileNotFoundError(f"no eval reports under {parent}/<experiment>/<run>/eval: run "
                                "`python eval.py run_dir=<run dir>` first")
    return runs


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
