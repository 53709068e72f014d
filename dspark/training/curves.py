"""A training run's curves: train loss, lr and held-out tau_prob by step, read from its CSV logs (every version: a
resumed run writes a new one) and drawn as RUN/curves.png when matplotlib is installed."""
from __future__ import annotations

import csv
import logging
from pathlib import Path

from dspark import plotting

log = logging.getLogger("dspark.train")

CURVES_FILE = "curves.png"


def metric_series(run_dir: Path, names=("train/loss", "lr-", "val/tau_prob")) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] from the run's logs/version_*/metrics.csv (every version: a resumed run writes a new
    one; a step logged twice keeps the later value). A name ending in "-" takes every column it begins (lr-AdamW)."""
    out: dict[str, dict[int, float]] = {}
    versions = sorted((Path(run_dir) / "logs").glob("version_*/metrics.csv"),
                      key=lambda f: int(f.parent.name.split("_")[-1]) if f.parent.name.split("_")[-1].isdigit() else -1)
    for file in versions:
        with open(file, newline="") as fh:
            for row in csv.DictReader(fh):
                for col, value in row.items():
                    if value in (None, "") or col is None or not any(
                            col == n or (n.endswith("-") and col.startswith(n)) for n in names):
                        continue
                    out.setdefault(col, {})[int(row["step"])] = float(value)
    return {col: sorted(points.items()) for col, points in out.items()}


def write_curves(run_dir: Path, title: str = "") -> Path | None:
    """RUN/curves.png: train loss, lr and held-out val/tau_prob by step (metric_series); None, with a log line
    saying why, without a CSV log or matplotlib."""
    series = metric_series(run_dir)
    if not series:
        log.info("no %s: the run has no metrics.csv with train/val metrics (the csv logger is off)", CURVES_FILE)
        return None
    try:
        order = ["train/loss", *sorted(k for k in series if k.startswith("lr-")), "val/tau_prob"]
        return plot_training_curves({k: series[k] for k in order if k in series}, Path(run_dir) / CURVES_FILE, title)
    except ImportError:
        log.info("no %s: matplotlib is not installed (pip install 'dspark[plots]')", CURVES_FILE)
        return None


def plot_training_curves(series: dict[str, list[tuple[int, float]]], path: Path, title: str = "") -> Path:
    """One panel per series (name -> [(step, value)], e.g. train/loss, lr-AdamW, val/tau_prob), step on x."""
    plt = plotting.pyplot()
    names = [k for k, v in series.items() if v]
    if not names:
        raise ValueError("no series to plot")
    fig, axes = plt.subplots(len(names), 1, figsize=(6, 2.2 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps, values = zip(*sorted(series[name]))
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=name)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    try:
        return plotting.save_png(fig, path)  # whole or not at all
    finally:
        plt.close(fig)
