"""PNG plots of eval reports: per-position conditional acceptance per benchmark, the reliability diagram
(matplotlib through dspark.plotting). A training run's curves are dspark.training.curves'."""
from __future__ import annotations

from pathlib import Path

from dspark.plotting import pyplot, save_png


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        return save_png(fig, path)  # whole or not at all
    finally:
        plt.close(fig)


def plot_conditional_acceptance(reports: dict[str, dict], path: Path) -> Path:
    """One line per benchmark: conditional acceptance rate r_i / r_{i-1} at draft position i (1-based)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, r in reports.items():
        cond = r["per_position_conditional_rate"]
        xs = [i + 1 for i, v in enumerate(cond) if v is not None]
        ax.plot(xs, [v for v in cond if v is not None], marker="o", label=f"{name} (AL {r['mean_acceptance_length']:.2f})")
    any_r = next(iter(reports.values()))
    ax.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.02),
           title=f"T={any_r['temperature']:g}, gamma={any_r['gamma']}")
    n = max((len(r["per_position_conditional_rate"]) for r in reports.values()), default=0)
    ax.set_xticks(range(1, n + 1))  # positions are integers: no ticks at 1.5, 2.5
    return _save(plt, fig, ax, path)


def plot_reliability(calibration: dict, path: Path) -> Path:
    """Pooled reliability diagram of the survival estimates, before and after STS (held-out blocks)."""
    plt = pyplot()
    pooled = calibration["pooled"]
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
    for key, label in (("reliability_before", f"before (ECE {pooled['ece_before']:.3f})"),
                       ("reliability_after", f"after STS (ECE {pooled['ece_after']:.3f})")):
        table = pooled[key]
        pts = [(c, a) for c, a, n in zip(table["confidence"], table["accuracy"], table["counts"]) if n]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set(xlabel="predicted P(prefix accepted)", ylabel="observed frequency", xlim=(0, 1), ylim=(0, 1),
           title="confidence head reliability (held-out blocks)")
    return _save(plt, fig, ax, path)
