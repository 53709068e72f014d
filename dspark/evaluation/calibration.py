"""Confidence-head calibration: ECE, ROC-AUC, survival curves, Sequential Temperature Scaling (docs/CONTRACTS.md §3).

The confidence head emits one logit per draft position, c_k = sigmoid(logit_k) (docs/CONTRACTS.md §2.7): the
probability that draft k survives verification given that drafts 1..k-1 did. The survival
a_k = prod_{j<=k} c_j is then the probability that the first k drafts are all accepted, and the
observable it is scored against is `accepted_len >= k` (accepted_len = number of drafts accepted in the
block, 0..g, bonus token not counted).

Everything here is a pure function of arrays: inputs may be torch tensors, numpy arrays or lists; the
work is done in float64 numpy and results are numpy arrays / Python floats (JSON-ready in the report).

Shapes: N = number of verified blocks (one per verify step and request), g = drafts per block.
Blocks must have all g positions scored; DeepSpec drops positions past an accepted EOS from its
metrics, so a caller with such blocks should either drop them or cut them to a common g.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

DEFAULT_GRID = np.logspace(np.log10(0.05), np.log10(20.0), 81)  # [81], symmetric in log T, contains 1.0


def _np(x: Any, name: str) -> np.ndarray:
    """float64 numpy copy of a tensor / array / list."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _check_2d(conf_logits: Any) -> np.ndarray:
    z = _np(conf_logits, "conf_logits")
    if z.ndim != 2:
        raise ValueError(f"conf_logits must be [N, g], got shape {tuple(z.shape)}")
    if not np.all(np.isfinite(z)):
        raise ValueError("conf_logits contains NaN or inf")
    return z


def _check_accepted_len(accepted_len: Any, n: int, g: int) -> np.ndarray:
    acc = _np(accepted_len, "accepted_len")
    if acc.ndim != 1 or acc.shape[0] != n:
        raise ValueError(f"accepted_len must be [N] with N={n}, got shape {tuple(acc.shape)}")
    if np.any(acc != np.round(acc)) or np.any(acc < 0) or np.any(acc > g):
        raise ValueError(f"accepted_len must hold integers in 0..g={g}")
    return acc.astype(np.int64)


def _check_temperatures(temperatures: Any, g: int) -> np.ndarray:
    t = _np(temperatures, "temperatures")
    if t.ndim != 1 or t.shape[0] != g:
        raise ValueError(f"temperatures must be [g] with g={g}, got shape {tuple(t.shape)}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def probs_to_logits(probs: Any, eps: float = 1e-7) -> np.ndarray:
    """Inverse sigmoid, clipped to [eps, 1-eps]: for callers that only kept c_k = sigmoid(logit_k)
    (e.g. `Proposal.conf`). Prefer the raw logits when available (no clipping loss)."""
    p = np.clip(_np(probs, "probs"), eps, 1.0 - eps)
    return np.log(p) - np.log1p(-p)


def outcomes_from_accepted_len(accepted_len: Any, g: int) -> np.ndarray:
    """[N] accepted_len -> [N, g] {0,1}: column k-1 is 1 iff the first k drafts were all accepted."""
    acc = _np(accepted_len, "accepted_len")
    if acc.ndim != 1:
        raise ValueError(f"accepted_len must be [N], got shape {tuple(acc.shape)}")
    acc = _check_accepted_len(acc, acc.shape[0], g)
    return (acc[:, None] >= np.arange(1, g + 1)[None, :]).astype(np.float64)


# ----------------------------------------------------------------------------------------------- metrics
def _bin_stats(probs: np.ndarray, outcomes: np.ndarray, n_bins: int):
    """Per equal-width bin on [0, 1]: counts [n_bins], sum of outcomes, sum of probs. p == 1 goes to the
    last bin; bin b holds [b/n, (b+1)/n)."""
    idx = np.minimum((probs * n_bins).astype(np.int64), n_bins - 1)
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    acc_sum = np.bincount(idx, weights=outcomes, minlength=n_bins)
    conf_sum = np.bincount(idx, weights=probs, minlength=n_bins)
    return counts, acc_sum, conf_sum


def _check_probs_outcomes(probs: Any, outcomes: Any) -> tuple[np.ndarray, np.ndarray]:
    p, y = _np(probs, "probs"), _np(outcomes, "outcomes")
    if p.ndim != 1 or y.shape != p.shape:
        raise ValueError(f"probs and outcomes must both be [N], got {tuple(p.shape)} and {tuple(y.shape)}")
    if np.any(~np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ValueError("probs must be finite and in [0, 1]")
    if np.any((y != 0) & (y != 1)):
        raise ValueError("outcomes must be 0 or 1")
    return p, y


def ece(probs: Any, outcomes: Any, n_bins: int = 15) -> float:
    """Expected calibration error of binary predictions.

    probs [N] in [0, 1], outcomes [N] in {0, 1}. Equal-width bins on [0, 1] (bin b = [b/n, (b+1)/n),
    p = 1 in the last); ECE = sum_b (|B_b| / N) |mean(outcomes in b) - mean(probs in b)|. N = 0 -> nan.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p, y = _check_probs_outcomes(probs, outcomes)
    if p.size == 0:
        return float("nan")
    counts, acc_sum, conf_sum = _bin_stats(p, y, n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / p.size)  # sum_b |B_b|/N * |acc_b - conf_b|


def reliability_table(probs: Any, outcomes: Any, n_bins: int = 15) -> dict[str, list]:
    """Reliability-diagram data: per equal-width bin its center, accuracy (mean outcome), confidence
    (mean prob) and count. Empty bins have accuracy / confidence None (skip them when plotting)."""
    p, y = _check_probs_outcomes(probs, outcomes)
    counts, acc_sum, conf_sum = _bin_stats(p, y, n_bins)
    centers = (np.arange(n_bins) + 0.5) / n_bins
    nz = counts > 0
    acc = [float(a / c) if k else None for a, c, k in zip(acc_sum, counts, nz)]
    conf = [float(s / c) if k else None for s, c, k in zip(conf_sum, counts, nz)]
    return {"bin_centers": centers.tolist(), "accuracy": acc, "confidence": conf,
            "counts": counts.astype(int).tolist()}


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x [N], ties get the mean of the ranks they span."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks_sorted = np.empty(x.size, dtype=np.float64)
    # boundaries of runs of equal values
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], x.size]
    for s, e in zip(starts, ends):
        ranks_sorted[s:e] = 0.5 * (s + 1 + e)  # mean of ranks s+1..e
    ranks = np.empty_like(ranks_sorted)
    ranks[order] = ranks_sorted
    return ranks


def roc_auc(scores: Any, labels: Any) -> float | None:
    """Area under the ROC curve, via the Mann-Whitney U statistic with average ranks for ties:
    AUC = P(score_pos > score_neg) + 0.5 P(equal).

    scores [N] (any real), labels [N] in {0, 1}. Pairs whose score or label is NaN are dropped. Returns
    None when, after that, one class is absent (AUC undefined)."""
    s, y = _np(scores, "scores"), _np(labels, "labels")
    if s.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"scores and labels must both be [N], got {tuple(s.shape)} and {tuple(y.shape)}")
    keep = ~(np.isnan(s) | np.isnan(y))
    s, y = s[keep], y[keep]
    if np.any((y != 0) & (y != 1)):
        raise ValueError("labels must be 0 or 1")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    r = _average_ranks(s)
    u = r[y == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


# ----------------------------------------------------------------------------------------------- survival
def survival(conf_logits: Any, temperatures: Any | None = None) -> np.ndarray:
    """[N, g] confidence logits (+ optional [g] temperatures, > 0) -> [N, g] survival
    a[:, k] = prod_{j<=k} sigmoid(logit_j / T_j): estimated P(first k+1 drafts all accepted).
    Non-increasing in k by construction."""
    z = _check_2d(conf_logits)
    if temperatures is not None:
        z = z / _check_temperatures(temperatures, z.shape[1])[None, :]
    return np.cumprod(sigmoid(z), axis=1)


def fit_sequential_temperature_scaling(
    conf_logits: Any, accepted_len: Any, grid: Sequence[float] | None = None, n_bins: int = 15
) -> np.ndarray:
    """Sequential Temperature Scaling (DSpark paper; docs/CONTRACTS.md §3). Returns temperatures [g].

    conf_logits [N, g] raw confidence logits on a held-out split; accepted_len [N] in 0..g.
    For k = 1..g: T_k = argmin over `grid` (default 81 log-spaced values in [0.05, 20], including 1) of
        ECE( prod_{j<=k} sigmoid(logit_j / T_j),  1[accepted_len >= k] )
    with T_1..T_{k-1} fixed at their fitted values.

    Choice of population: ALL N blocks at every position (not only those whose first k-1 drafts were
    accepted). docs/CONTRACTS.md §3 and the paper define the objective as the ECE of the cumulative product, an
    unconditional quantity (P(first k accepted)) that the scheduler and the threshold rule consume;
    DeepSpec's confidence evaluation (deepspec/eval/dspark/confidence_head.py) likewise scores
    cumprod(sigmoid(logits)) against the accepted-prefix mask on every proposal, per position. (DeepSpec
    ships no STS fitting code; conditioning on survival of k-1 would instead calibrate c_k alone.)

    Ties in ECE (within 1e-12) are broken toward T closest to 1 (so degenerate positions, e.g. all
    outcomes equal with saturated logits, stay at T = 1).
    """
    z = _check_2d(conf_logits)
    n, g = z.shape
    if n == 0:
        raise ValueError("need at least one block to fit temperatures")
    acc = _check_accepted_len(accepted_len, n, g)
    grid_arr = DEFAULT_GRID if grid is None else _np(grid, "grid")
    if grid_arr.ndim != 1 or grid_arr.size == 0:
        raise ValueError("grid must be a non-empty 1-D sequence of temperatures")
    if np.any(~np.isfinite(grid_arr)) or np.any(grid_arr <= 0):
        raise ValueError("grid temperatures must be finite and > 0")
    temps = np.ones(g)
    prefix = np.ones(n)  # [N] prod_{j<k} sigmoid(logit_j / T_j)
    for k in range(g):
        y = (acc >= k + 1).astype(np.float64)
        eces = np.array([ece(prefix * sigmoid(z[:, k] / t), y, n_bins) for t in grid_arr])  # [len(grid)]
        best = np.flatnonzero(eces <= eces.min() + 1e-12)
        t_k = grid_arr[best[np.argmin(np.abs(np.log(grid_arr[best])))]]
        temps[k] = t_k
        prefix = prefix * sigmoid(z[:, k] / t_k)
    return temps


def at_fit_bounds(temperatures: Any, grid: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """The positions whose fitted temperature is an end of the fit grid (default DEFAULT_GRID, [0.05, 20]):
    [{"k": 1-based position, "T": value, "bound": "lower" | "upper"}]. Such a T is where the search stopped, not an
    optimum (typically a position whose drafts are (almost) never or always accepted in the fit split)."""
    grid_arr = DEFAULT_GRID if grid is None else _np(grid, "grid")
    lo, hi = float(grid_arr.min()), float(grid_arr.max())
    out = []
    for k, t in enumerate(np.asarray(temperatures, dtype=np.float64).reshape(-1)):
        for bound, edge in (("lower", lo), ("upper", hi)):
            if np.isclose(t, edge, rtol=1e-9, atol=0.0):
                out.append({"k": k + 1, "T": float(t), "bound": bound})
    return out


def calibration_report(
    conf_logits: Any, accepted_len: Any, temperatures: Any | None, n_bins: int = 15
) -> dict[str, Any]:
    """Per-position calibration before (T = 1) and after (`temperatures`, [g]; None = identity).

    Returns a JSON-ready dict:
      temperatures: [g]
      n_blocks: N
      positions: list of g dicts, k = 1..g:
        k, n, acceptance (empirical P(first k accepted)),
        ece_before / ece_after            survival a_k vs 1[accepted_len >= k], all N blocks
        auc_before / auc_after            ROC-AUC of a_k for the same outcome (None if one class absent)
        cond_n, cond_auc                  ROC-AUC of the raw logit_k for "draft k accepted" on blocks whose
                                          first k-1 were accepted (temperature-invariant: a monotone map)
        reliability_before / _after       reliability_table(a_k, outcome)
      pooled: ece_before / ece_after and reliability tables over all (block, position) pairs.
    """
    z = _check_2d(conf_logits)
    n, g = z.shape
    acc = _check_accepted_len(accepted_len, n, g)
    temps = np.ones(g) if temperatures is None else _check_temperatures(temperatures, g)
    a0, a1 = survival(z), survival(z, temps)  # [N, g]
    y = (acc[:, None] >= np.arange(1, g + 1)[None, :]).astype(np.float64)  # [N, g]
    positions = []
    for k in range(g):
        cond = acc >= k  # first k-1 (0-based: k) accepted
        positions.append({
            "k": k + 1,
            "n": n,
            "acceptance": float(y[:, k].mean()) if n else float("nan"),
            "ece_before": ece(a0[:, k], y[:, k], n_bins),
            "ece_after": ece(a1[:, k], y[:, k], n_bins),
            "auc_before": roc_auc(a0[:, k], y[:, k]),
            "auc_after": roc_auc(a1[:, k], y[:, k]),
            "cond_n": int(cond.sum()),
            "cond_auc": roc_auc(z[cond, k], y[cond, k]),
            "reliability_before": reliability_table(a0[:, k], y[:, k], n_bins),
            "reliability_after": reliability_table(a1[:, k], y[:, k], n_bins),
        })
    flat_y = y.reshape(-1)
    return {
        "temperatures": temps.tolist(),
        "n_blocks": n,
        "n_bins": n_bins,
        "positions": positions,
        "pooled": {
            "ece_before": ece(a0.reshape(-1), flat_y, n_bins),
            "ece_after": ece(a1.reshape(-1), flat_y, n_bins),
            "reliability_before": reliability_table(a0.reshape(-1), flat_y, n_bins),
            "reliability_after": reliability_table(a1.reshape(-1), flat_y, n_bins),
        },
    }


def kept_lengths(surv: Any, threshold: float) -> np.ndarray:
    """[N, g] survival -> [N] int: length of the longest prefix with survival >= threshold."""
    a = _np(surv, "survival")
    if a.ndim != 2:
        raise ValueError(f"survival must be [N, g], got shape {tuple(a.shape)}")
    return np.cumprod(a >= threshold, axis=1).sum(axis=1).astype(np.int64)


def threshold_sweep(surv: Any, accepted_len: Any, thresholds: Sequence[float]) -> list[dict[str, float]]:
    """Confidence-threshold verification rule: keep the longest draft prefix with survival >= threshold.

    surv [N, g] survival curves (e.g. `survival(logits, temps)`), accepted_len [N] in 0..g measured with
    all g drafts. Truncating a block to l drafts accepts min(accepted_len, l) of them (acceptance of a
    prefix does not depend on later drafts). Per threshold (all means over the N blocks):
      drafts_kept              mean l
      verified_tokens          mean 1 + l  (anchor/bonus slot + drafts: the verify batch per step)
      accepted                 mean min(accepted_len, l)  (drafts accepted, bonus not counted)
      tokens_per_step          1 + accepted  (emitted tokens per step incl. the bonus token)
      acceptance_per_verified  sum(1 + min(accepted_len, l)) / sum(1 + l): emitted per verified token
    """
    a = _np(surv, "survival")
    if a.ndim != 2:
        raise ValueError(f"survival must be [N, g], got shape {tuple(a.shape)}")
    n, g = a.shape
    if n == 0:
        raise ValueError("need at least one block")
    acc = _check_accepted_len(accepted_len, n, g)
    out = []
    for t in thresholds:
        l = kept_lengths(a, float(t))  # [N]
        m = np.minimum(acc, l)
        out.append({
            "threshold": float(t),
            "drafts_kept": float(l.mean()),
            "verified_tokens": float((1 + l).mean()),
            "accepted": float(m.mean()),
            "tokens_per_step": float((1 + m).mean()),
            "acceptance_per_verified": float((1 + m).sum() / (1 + l).sum()),
        })
    return out
