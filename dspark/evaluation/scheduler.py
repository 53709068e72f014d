"""Hardware-aware prefix scheduler simulation (DSpark paper Alg. 1; docs/CONTRACTS.md §3).

Each of R requests in a decode step has g drafts with survival a[r, j] = prod_{i<=j} c[r, i] (estimated
P(first j+1 drafts of request r accepted), e.g. `calibration.survival(conf_logits, temperatures)`).
Verifying l_r drafts of request r costs 1 + l_r target tokens (anchor/bonus slot + drafts) and yields,
in expectation, 1 + sum_{j<l_r} a[r, j] emitted tokens. With B = sum_r (1 + l_r) tokens in the verify
batch and SPS(B) target verify steps per second at that batch size, the expected throughput is

    objective = tau * SPS(B)   tokens / s,     tau = sum_r (1 + sum_{j<l_r} a[r, j]).

The scheduler admits (r, j) pairs in descending a (request r's draft j only after its draft j-1: the
prefix constraint) and keeps the admitted set with the best objective.

Shapes: a [R, g] in [0, 1]; lengths [R] ints in 0..g. Indices here are 0-based: a[:, 0] is draft 1.
"""
from __future__ import annotations

import heapq
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

SPS = Callable[[float], float]  # steps per second as a function of the verify batch size B (tokens)


class SPSTable:
    """SPS(B) from a profiled table, linearly interpolated in B; outside the table the end values are
    held (no extrapolation: a batch larger than anything profiled is assumed no faster than the largest).

    batch_sizes [M] strictly increasing positive ints/floats, sps [M] > 0 steps per second."""

    def __init__(self, batch_sizes: Sequence[float], sps: Sequence[float]):
        b = np.asarray(batch_sizes, dtype=np.float64)
        s = np.asarray(sps, dtype=np.float64)
        if b.ndim != 1 or s.shape != b.shape or b.size == 0:
            raise ValueError(f"batch_sizes and sps must be equal-length non-empty 1-D, got {b.shape}, {s.shape}")
        if np.any(np.diff(b) <= 0):
            raise ValueError("batch_sizes must be strictly increasing")
        if np.any(~np.isfinite(s)) or np.any(s <= 0) or np.any(b <= 0):
            raise ValueError("batch_sizes and sps must be finite and > 0")
        self.batch_sizes, self.sps = b, s

    def __call__(self, batch: float) -> float:
        return float(np.interp(float(batch), self.batch_sizes, self.sps))

    def to_dict(self) -> dict[str, list[float]]:
        return {"batch_sizes": self.batch_sizes.tolist(), "sps": self.sps.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Sequence[float]]) -> "SPSTable":
        return cls(d["batch_sizes"], d["sps"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "SPSTable":
        """A JSON file {"batch_sizes": [...], "sps": [...]}."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def profile_sps(
    target_forward: Callable[[int], Any],
    batch_sizes: Sequence[int],
    warmup: int = 1,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> SPSTable:
    """Time `target_forward(B)` (one verify forward over B tokens: build its inputs outside the timed
    call, or accept their cost) for each B; SPS(B) = 1 / median wall time. `sync` (e.g.
    torch.cuda.synchronize) runs after each call so asynchronous kernels are counted."""
    if warmup < 0 or repeats < 1:
        raise ValueError("need warmup >= 0 and repeats >= 1")
    bs = sorted(int(b) for b in batch_sizes)
    sps = []
    for b in bs:
        for _ in range(warmup):
            target_forward(b)
            if sync is not None:
                sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target_forward(b)
            if sync is not None:
                sync()
            times.append(time.perf_counter() - t0)
        sps.append(1.0 / max(float(np.median(times)), 1e-9))
    return SPSTable(bs, sps)


def _check_a(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"survival a must be [R, g], got shape {tuple(arr.shape)}")
    if np.any(~np.isfinite(arr)) or np.any(arr < 0) or np.any(arr > 1):
        raise ValueError("survival a must be finite and in [0, 1]")
    return arr


def _sps_fn(sps: SPS | SPSTable | dict) -> SPS:
    return SPSTable.from_dict(sps) if isinstance(sps, dict) else sps


def _sps_value(fn: SPS, batch: int) -> float:
    v = float(fn(batch))
    if not np.isfinite(v) or v < 0:
        raise ValueError(f"SPS({batch}) = {v}: must be finite and >= 0")
    return v


@dataclass
class Schedule:
    lengths: np.ndarray  # [R] int drafts verified per request
    batch: int  # B = sum(1 + l_r)
    tau: float  # expected emitted tokens in the step = sum(1 + sum_{j<l_r} a[r, j])
    sps: float  # SPS(B)
    objective: float  # tau * SPS(B): expected tokens per second
    admissions: int = 0  # (r, j) pairs evaluated before stopping

    def to_dict(self) -> dict[str, Any]:
        return {"lengths": self.lengths.tolist(), "batch": self.batch, "tau": self.tau, "sps": self.sps,
                "objective": self.objective, "admissions": self.admissions}


def evaluate_lengths(a: Any, lengths: Sequence[int], sps: SPS | SPSTable | dict) -> Schedule:
    """Objective of a given assignment: a [R, g], lengths [R] in 0..g."""
    arr = _check_a(a)
    fn = _sps_fn(sps)
    l = np.asarray(lengths, dtype=np.int64)
    if l.shape != (arr.shape[0],) or np.any(l < 0) or np.any(l > arr.shape[1]):
        raise ValueError(f"lengths must be [R={arr.shape[0]}] ints in 0..g={arr.shape[1]}")
    mask = np.arange(arr.shape[1])[None, :] < l[:, None]  # [R, g]
    tau = float(arr.shape[0] + (arr * mask).sum())
    batch = int((1 + l).sum())
    s = _sps_value(fn, batch)
    return Schedule(l, batch, tau, s, float(tau * s))


def schedule_prefix(
    a: Any,
    sps: SPS | SPSTable | dict,
    patience: int | None = None,
    max_batch: int | None = None,
) -> Schedule:
    """Hardware-aware prefix scheduler (paper Alg. 1).

    a [R, g] survival curves; sps: SPS(B) callable, SPSTable, or its dict.
    Start from l_r = 0 for every request (B = R, tau = R: each request verifies its anchor only). Then
    repeatedly admit the frontier pair (r, l_r) with the largest a[r, l_r] (frontier = the next draft of
    each request, which enforces the prefix constraint; ties -> lowest r), update B += 1 and
    tau += a[r, l_r], evaluate tau * SPS(B), and remember the best assignment seen.

    Early stop: after `patience` consecutive admissions without a strict improvement of the best
    objective the scan ends (None = scan all R*g pairs). `max_batch` caps B (admissions stop there).

    Optimality: when every row of `a` is non-increasing (true for survival curves, a product of
    factors in [0, 1]), the greedy order is the global descending order, so after n admissions tau is
    the largest achievable with B = R + n; scanning every n (patience=None or >= R*g) therefore finds
    the exact optimum of tau * SPS(B) over all prefix-feasible assignments, for ANY SPS. With a small
    patience the scan can stop in a dip of the objective and miss a later optimum, e.g. an SPS curve
    with a cliff followed by a plateau (tests/evaluation/test_scheduler.py shows one). For a monotone
    non-increasing SPS and a concave-enough tau the objective is unimodal in n and a small patience is
    safe in practice, but not guaranteed.
    """
    arr = _check_a(a)
    fn = _sps_fn(sps)
    if patience is not None and patience < 1:
        raise ValueError(f"patience must be >= 1 or None, got {patience}")
    r_count, g = arr.shape
    lengths = np.zeros(r_count, dtype=np.int64)
    batch, tau = r_count, float(r_count)
    best_obj = tau * _sps_value(fn, batch)
    best = (lengths.copy(), batch, tau, best_obj)
    heap = [(-arr[r, 0], r) for r in range(r_count)] if g > 0 else []
    heapq.heapify(heap)
    since_best, admissions = 0, 0
    while heap:
        if max_batch is not None and batch + 1 > max_batch:
            break
        neg_a, r = heapq.heappop(heap)
        lengths[r] += 1
        batch += 1
        tau += float(-neg_a)
        admissions += 1
        if lengths[r] < g:
            heapq.heappush(heap, (-arr[r, lengths[r]], r))
        obj = tau * _sps_value(fn, batch)
        if obj > best_obj:
            best_obj, best, since_best = obj, (lengths.copy(), batch, tau, obj), 0
        else:
            since_best += 1
            if patience is not None and since_best >= patience:
                break
    l, b, t, o = best
    return Schedule(l, b, float(t), _sps_value(fn, b), float(o), admissions)


def fixed_length_objective(a: Any, length: int, sps: SPS | SPSTable | dict) -> Schedule:
    """Every request verifies `length` drafts (0..g): B = R (1 + L), tau = sum_r (1 + sum_{j<L} a[r, j])."""
    arr = _check_a(a)
    if not 0 <= length <= arr.shape[1]:
        raise ValueError(f"length must be in 0..g={arr.shape[1]}, got {length}")
    return evaluate_lengths(arr, np.full(arr.shape[0], length), sps)


def best_fixed_length(a: Any, sps: SPS | SPSTable | dict) -> Schedule:
    """The best single fixed verify length L in 0..g for this batch (ties -> smaller L)."""
    arr = _check_a(a)
    scheds = [fixed_length_objective(arr, L, sps) for L in range(arr.shape[1] + 1)]
    return max(scheds, key=lambda s: (s.objective, -s.batch))


def simulate(
    steps: Sequence[Any], sps: SPS | SPSTable | dict, patience: int | None = None,
    fixed_lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Expected throughput over a sequence of decode steps, each a [R_t, g] survival matrix.

    Returns the mean objective (expected tokens/s) of the prefix scheduler and of each fixed length
    (default 0..g), and the scheduler's mean B and tau. Each step is scored independently (steps run
    one after another, so the reported tokens/s is the time-weighted mean: sum tau / sum 1/SPS)."""
    if len(steps) == 0:
        raise ValueError("need at least one step")
    arrs = [_check_a(s) for s in steps]
    g = arrs[0].shape[1]
    if any(x.shape[1] != g for x in arrs):
        raise ValueError("every step must have the same g")
    fixed = list(range(g + 1)) if fixed_lengths is None else list(fixed_lengths)

    def tokens_per_s(scheds: list[Schedule]) -> float:
        secs = sum(1.0 / s.sps if s.sps > 0 else float("inf") for s in scheds)
        return sum(s.tau for s in scheds) / secs

    sched = [schedule_prefix(x, sps, patience=patience) for x in arrs]
    out: dict[str, Any] = {
        "scheduler": {"tokens_per_s": tokens_per_s(sched),
                      "mean_batch": float(np.mean([s.batch for s in sched])),
                      "mean_tau": float(np.mean([s.tau for s in sched]))},
        "fixed": {},
    }
    for L in fixed:
        fs = [fixed_length_objective(x, L, sps) for x in arrs]
        out["fixed"][L] = {"tokens_per_s": tokens_per_s(fs),
                           "mean_batch": float(np.mean([s.batch for s in fs])),
                           "mean_tau": float(np.mean([s.tau for s in fs]))}
    best_l = max(out["fixed"], key=lambda L: out["fixed"][L]["tokens_per_s"])
    out["best_fixed_length"] = best_l
    out["speedup_vs_best_fixed"] = out["scheduler"]["tokens_per_s"] / out["fixed"][best_l]["tokens_per_s"]
    return out
