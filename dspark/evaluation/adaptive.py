"""Adaptive verification (vLLM 0.33.0 `speculative_config.enable_adaptive_verification`, config/speculative.py:585-587):
what it would do on eval.py's recorded verify steps with the draft's confidence head versus vLLM's online
acceptance estimator, both fed to the prefix scheduler (dspark.evaluation.scheduler.schedule_prefix).

vLLM (v1/worker/gpu/spec_decode/ of 0.33.0): with adaptive verification on, a DSpark draft WITH a confidence head
ranks draft slots by the head's probabilities (dspark/speculator.py:106-113, 190-212); WITHOUT one, the
`OnlineAcceptanceEstimator` (acceptance_estimator.py:313-502) predicts them from the draft logits alone. Either way
`AdaptiveVerificationManager` (adaptive_verification.py:144-488) admits the slots of highest survival (running
product of the per-position probabilities, :46-72) up to a budget that maximises estimated accepted tokens per
cost (:305-373). Here the budget is chosen by our prefix scheduler on the same survival (tau * SPS(B), the
existing simulation); vLLM picks the budget from one-step-stale confidences (:279-304, :332) and ranks with the
current ones: not modelled (both use the current round's).

The online estimator, transcribed (`OnlineAcceptanceEstimator` below, torch fp32 as vLLM):
  feature f = logit(max_x q(x)) of the draft distribution q = softmax(logits / T) (T = 1 when the request is
     greedy), = -log(sum_{z != argmax} e^{z - m*}), clamped to [-40, 40]   (_predict_kernel :219-310, :11-13)
  prediction p_k = sigmoid(w f + b_k): one shared slope w, one intercept b_k per draft position, cold start
     w = 0.5, b_k = -0.2                                                     (:15-20, :305-310, :351-355)
  after each engine step, the verdict is folded into IRLS statistics (_accumulate_kernel :23-88): a request with
     A accepted and L verified drafts labels positions k <= A with k < L (label 1 for k < A, 0 for the first
     rejected); weight p(1-p), residual label - p; per position a_k += w f^2, b_k += w f, c_k += w,
     g0_k += r f, g1_k += r, n_k += 1
  every 100 engine steps one damped Newton step on the arrowhead system (XᵀWX + λI) Δθ = Xᵀ(y - p), λ = 1e-3
     (_refit_kernel :91-160): Δw = (g0 - Σ b_k g1_k / c_k) / (a - Σ b_k² / c_k) with a = Σ a_k + λ, c_k += λ,
     damped by N / (N + 50) (N = all observations), dropped when NaN or when it would make w negative;
     Δb_k = (g1_k - b_k Δw) / c_k damped by n_k / (n_k + 50), NaN -> 0; the statistics are then cleared.
Verdicts under trimming: a request verified with l drafts of which n would be accepted in full verification
accepts min(n, l) (exact for token-by-token verification: its decisions do not look ahead; block verification
looks ahead, so for it this is an approximation), so the estimator learns from L = l, A = min(n, l) as vLLM's would.

Realised throughput per policy: sum over rounds of the emitted tokens (1 + min(n_r, l_r) per request) over the
sum of 1 / SPS(B) (B = sum 1 + l_r): the measured outcome of each policy's lengths on the recorded drafts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.evaluation import scheduler as sch

MAX_LOG_ODDS = 40.0  # acceptance_estimator.py:13
INIT_SLOPE, INIT_BIAS = 0.5, -0.2  # :19-20


def estimator_features(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] (draft logits before temperature) -> [...] fp32 logit(max q), q = softmax(logits / T) with
    T = 1 for a greedy request (acceptance_estimator.py:195-216, :280-302)."""
    t = temperature if temperature > 0 else 1.0
    z = logits.float() / t
    m = z.max(dim=-1, keepdim=True).values
    total = torch.exp(z - m).sum(dim=-1)  # the max contributes exactly 1
    complement = (total - 1.0).clamp_min(0.0)
    return (-torch.log(complement)).clamp(-MAX_LOG_ODDS, MAX_LOG_ODDS)


class OnlineAcceptanceEstimator:
    """vLLM's per-position acceptance predictor that refits itself while serving (module docstring)."""

    REFIT_INTERVAL = 100  # acceptance_estimator.py:330
    DAMPING_OBSERVATIONS = 50.0  # :336
    L2 = 1e-3  # :338

    def __init__(self, num_speculative_steps: int):
        g = int(num_speculative_steps)
        self.g = g
        self.slope = torch.full((), INIT_SLOPE, dtype=torch.float32)
        self.intercepts = torch.full((g,), INIT_BIAS, dtype=torch.float32)
        self.info = torch.zeros(g, 3, dtype=torch.float32)  # [a_k, b_k, c_k]
        self.grad = torch.zeros(g, 2, dtype=torch.float32)  # [g0_k, g1_k]
        self.counts = torch.zeros(g, dtype=torch.float32)
        self.steps_since_refit = 0
        self.refits = 0

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """features [R, g] -> acceptance probabilities [R, g] = sigmoid(w f + b_k) (_predict_kernel :305-310)."""
        return torch.sigmoid(self.slope * features.float() + self.intercepts[: features.shape[1]])

    def step(self, features: torch.Tensor, predictions: torch.Tensor, num_accepted: torch.Tensor,
             num_verified: torch.Tensor) -> None:
        """One engine step's verdicts: features / predictions [R, g] (as predicted at draft time), num_accepted [R]
        (drafts accepted, bonus excluded), num_verified [R] (drafts the target verified). (step :405-449)"""
        f, p = features.float(), predictions.float()
        k = torch.arange(f.shape[1])[None, :]  # [1, g]
        acc, ver = num_accepted.long()[:, None], num_verified.long()[:, None]
        observed = (k <= acc) & (k < ver)  # the accepted drafts and the first rejected one (:66-68)
        label = (k < acc).float()
        w = torch.where(observed, p * (1.0 - p), 0.0)
        r = torch.where(observed, label - p, 0.0)
        g = f.shape[1]
        self.info[:g] += torch.stack([(w * f * f).sum(0), (w * f).sum(0), w.sum(0)], dim=1)
        self.grad[:g] += torch.stack([(r * f).sum(0), r.sum(0)], dim=1)
        self.counts[:g] += observed.float().sum(0)
        self.steps_since_refit += 1
        if self.steps_since_refit < self.REFIT_INTERVAL:
            return
        self.steps_since_refit = 0
        self.refit()
        self.refits += 1

    def refit(self) -> None:
        """One damped Newton step on the accumulated statistics, then clear them (_refit_kernel :91-160)."""
        lam, damp = self.L2, self.DAMPING_OBSERVATIONS
        a_k, b_k, c_k = self.info[:, 0], self.info[:, 1], self.info[:, 2] + lam
        a = a_k.sum() + lam
        g0, g1_k = self.grad[:, 0].sum(), self.grad[:, 1]
        n = self.counts
        step_w = (g0 - (b_k * g1_k / c_k).sum()) / (a - (b_k * b_k / c_k).sum())
        total = n.sum()
        step_w = step_w * (total / (total + damp))
        if torch.isnan(step_w) or self.slope + step_w < 0:
            step_w = torch.zeros_like(step_w)
        self.slope = self.slope + step_w
        step_b = (g1_k - b_k * step_w) / c_k * (n / (n + damp))
        self.intercepts = self.intercepts + torch.nan_to_num(step_b, nan=0.0)
        self.info.zero_(), self.grad.zero_(), self.counts.zero_()


@dataclass
class Round:
    """One engine step of one batch: per alive request its g draft-time numbers and its full-verification verdict."""

    features: np.ndarray  # [R, g] estimator features
    head: np.ndarray | None  # [R, g] confidence-head probabilities, None without a head
    accepted: np.ndarray  # [R] drafts accepted when all g are verified


def rounds_of(batches: Sequence[Sequence[Sequence]]) -> list[Round]:
    """Per batch, per request, its StepStats -> the engine steps in order (round j of a batch = its requests with
    more than j steps). Steps need `est_feature` (eval.py records it)."""
    out = []
    for batch in batches:
        for j in range(max((len(r) for r in batch), default=0)):
            steps = [r[j] for r in batch if len(r) > j]
            feats = np.asarray([s.est_feature for s in steps], dtype=np.float64)
            head = None if any(s.conf is None for s in steps) else np.asarray([s.conf for s in steps], np.float64)
            out.append(Round(feats, head, np.asarray([s.num_accepted for s in steps], dtype=np.int64)))
    return out


def _realised(rounds: Sequence[Round], lengths: Sequence[np.ndarray], sps) -> dict:
    tokens = secs = batch = verified = 0.0
    for rd, l in zip(rounds, lengths):
        b = int((1 + l).sum())
        tokens += float((1 + np.minimum(rd.accepted, l)).sum())
        secs += 1.0 / sch._sps_value(sch._sps_fn(sps), b)
        batch += b
        verified += float(l.sum())
    n = max(len(rounds), 1)
    return {"tokens_per_s": tokens / secs if secs else None, "mean_batch": batch / n,
            "mean_verified_drafts": verified / n, "emitted_tokens": int(tokens)}


def _policy(rounds: Sequence[Round], predict, sps, patience=None) -> tuple[dict, list[np.ndarray]]:
    """predict(round index, round) -> probabilities [R, g]; lengths from the prefix scheduler on their survival."""
    lengths, predicted = [], []
    for i, rd in enumerate(rounds):
        probs = np.clip(predict(i, rd), 0.0, 1.0)
        s = sch.schedule_prefix(np.cumprod(probs, axis=1), sps, patience=patience)
        lengths.append(s.lengths)
        predicted.append(s)
    secs = sum(1.0 / s.sps for s in predicted)
    out = _realised(rounds, lengths, sps)
    out["predicted_tokens_per_s"] = sum(s.tau for s in predicted) / secs if secs else None
    return out, lengths


def simulate(batches: Sequence[Sequence[Sequence]], sps) -> dict:
    """Adaptive verification with the confidence head (if every step has one) and with the online estimator, next to
    verifying every draft (vLLM without adaptive verification). batches: per batch, per request, StepStats."""
    rounds = rounds_of(batches)
    if not rounds:
        raise ValueError("no verify steps to simulate")
    g = rounds[0].features.shape[1]
    full = _realised(rounds, [np.full(len(rd.accepted), g) for rd in rounds], sps)
    est = OnlineAcceptanceEstimator(g)

    def estimator(i: int, rd: Round) -> np.ndarray:
        return est.predict(torch.from_numpy(rd.features)).double().numpy()

    probs_est: list[np.ndarray] = []
    for rd in rounds:  # predict, schedule, then fold the verdict in: the order vLLM runs them
        probs = estimator(0, rd)
        s = sch.schedule_prefix(np.cumprod(probs, axis=1), sps)
        probs_est.append(probs)
        est.step(torch.from_numpy(rd.features), torch.from_numpy(probs),
                 torch.from_numpy(np.minimum(rd.accepted, s.lengths)), torch.from_numpy(s.lengths))
    est_report, _ = _policy(rounds, lambda i, rd: probs_est[i], sps)
    est_report.update(refits=est.refits, slope=float(est.slope),
                      intercepts=[float(x) for x in est.intercepts],
                      note=f"refits every {OnlineAcceptanceEstimator.REFIT_INTERVAL} engine steps; "
                           f"{len(rounds)} steps here" + ("" if est.refits else ": still the cold-start "
                                                          "coefficients (w = 0.5, b = -0.2)"))
    out = {"engine_steps": len(rounds), "gamma": g, "verify_all": full, "estimator": est_report, "head": None}
    if all(rd.head is not None for rd in rounds):
        head, _ = _policy(rounds, lambda i, rd: rd.head, sps)
        out["head"] = head
        ref = est_report["tokens_per_s"]
        out["head_vs_estimator"] = head["tokens_per_s"] / ref if ref else None
        out["head_pays"] = bool(ref and head["tokens_per_s"] > ref)
    return out
