"""Confidence analysis of a real speculative-decoding run (docs/CONTRACTS.md §3): STS fitted on a held-out split,
calibration before/after, threshold sweep, and the prefix-scheduler simulation against fixed-length
verification with an SPS(B) curve of the target.

Inputs are the verify steps eval.py records (dspark.evaluation.speculative.StepStats), per request. Each
step contributes one block: its g raw confidence logits and accepted_len = number of drafts accepted.
Split: requests with an even index (within each benchmark) fit the temperatures, odd ones are scored.
Scheduler rounds: a request's j-th verify step ran in round j of its batch, so round j of a batch is the
set of that batch's requests with more than j steps.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dspark.evaluation import calibration as cal
from dspark.evaluation import scheduler as sch
from dspark.evaluation.speculative import StepStats
from dspark.evaluation.target_session import TargetSession
from dspark.targets.hf_target import FrozenTarget

THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SPS_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def blocks(steps: Sequence[Sequence[StepStats]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-request step lists -> (conf_logits [N, g], accepted_len [N]); steps without logits are refused."""
    rows, acc = [], []
    for per_request in steps:
        for s in per_request:
            if s.conf_logits is None:
                raise ValueError("a verify step has no confidence logits (the draft has no confidence head)")
            rows.append(s.conf_logits)
            acc.append(s.num_accepted)
    g = {len(r) for r in rows}
    if len(g) > 1:
        raise ValueError(f"blocks have different numbers of drafts {sorted(g)}")
    if not rows:
        return np.zeros((0, 0)), np.zeros(0, dtype=np.int64)
    return np.asarray(rows, dtype=np.float64), np.asarray(acc, dtype=np.int64)


def split_requests(steps: Sequence[Sequence[StepStats]]) -> tuple[list, list]:
    """(fit, held-out) request lists: even / odd request index."""
    return list(steps[0::2]), list(steps[1::2])


def rounds(batches: Sequence[Sequence[Sequence[StepStats]]], temperatures: np.ndarray) -> list[np.ndarray]:
    """Survival matrices [R_t, g] of every decode round; batches = per batch, per request, the steps."""
    out = []
    for batch in batches:
        n_rounds = max((len(r) for r in batch), default=0)
        for j in range(n_rounds):
            z = np.asarray([r[j].conf_logits for r in batch if len(r) > j], dtype=np.float64)
            out.append(cal.survival(z, temperatures))
    return out


def profile_target_sps(target: FrozenTarget, context: int = 128,
                       batch_sizes: Sequence[int] = SPS_BATCH_SIZES, repeats: int = 3) -> sch.SPSTable:
    """SPS(B): verify forwards per second of B new tokens over a cached `context`-token prefix (KV session,
    the eval path), rolled back after each call. On CUDA the device is synchronised around each call."""
    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    session = TargetSession(target, [torch.randint(0, vocab, (context,), generator=g)])
    session.prefill()
    sync = torch.cuda.synchronize if target.device.type == "cuda" else None

    def forward(b: int) -> None:
        session.forward(torch.randint(0, vocab, (1, b), generator=g))
        session.commit([0])

    return sch.profile_sps(forward, batch_sizes, warmup=1, repeats=repeats, sync=sync)


def confidence_report(
    batches: Sequence[Sequence[Sequence[StepStats]]],
    sps: sch.SPSTable | Callable[[float], float] | None,
    thresholds: Sequence[float] = THRESHOLDS,
) -> dict:
    """STS + calibration + threshold sweep + scheduler simulation. batches: per batch, per request, steps."""
    requests = [r for batch in batches for r in batch]
    fit, held = split_requests(requests)
    z_fit, acc_fit = blocks(fit)
    z_held, acc_held = blocks(held)
    if len(z_fit) == 0 or len(z_held) == 0:
        raise ValueError("need verify steps from at least two requests (one to fit STS, one to score)")
    temps = cal.fit_sequential_temperature_scaling(z_fit, acc_fit)
    report = {
        "split": {"fit_requests": len(fit), "fit_blocks": int(len(z_fit)), "heldout_requests": len(held),
                  "heldout_blocks": int(len(z_held))},
        "calibration": {**cal.calibration_report(z_held, acc_held, temps),
                        "fit_bounds": [float(cal.DEFAULT_GRID.min()), float(cal.DEFAULT_GRID.max())],
                        "temperatures_at_bound": cal.at_fit_bounds(temps)},
        "threshold_sweep": cal.threshold_sweep(cal.survival(z_held, temps), acc_held, thresholds),
    }
    if sps is not None:
        sim = sch.simulate(rounds(batches, temps), sps)
        sim["fixed"] = {str(k): v for k, v in sim["fixed"].items()}
        report["scheduler"] = sim
        if isinstance(sps, sch.SPSTable):
            report["sps_table"] = sps.to_dict()
    return report
