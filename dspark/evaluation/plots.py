"""PNG plots: of eval reports (per-position conditional acceptance per benchmark, reliability diagram) and of a
training run (train loss, lr and held-out tau_prob by step, from its metrics.csv).

matplotlib is imported lazily (extra `plots`), with the Agg backend (no display needed).
"""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG plots need matplotlib: pip install 'dspark[plots]' (or set plots=false)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_conditional_acceptance(reports: dict[str, dict], path: Path) -> Path:
    """One line per benchmark: conditional acceptance rate r_i / r_{i-1} at draft position i (1-based)."""
    plt = _pyplot()
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


def plot_training_curves(series: dict[str, list[tuple[int, float]]], path: Path, title: str = "") -> Path:
    """One panel per series (name -> [(step, value)], e.g. train/loss, lr-AdamW, val/tau_prob), step on x."""
    plt = _pyplot()
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reliability(calibration: dict, path: Path) -> Path:
    """Pooled reliability diagram of the survival estimates, before and after STS (held-out blocks)."""
    plt = _pyplot()
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
