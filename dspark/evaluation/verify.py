"""Verification of a drafted chain against the target (docs/CONTRACTS.md §2.8). Both verifiers are lossless.

Row k of the target tensors is the target's next-token distribution after [prefix, x0, y_0..y_{k-1}],
so g drafts come with g + 1 target rows (the last one gives the bonus token when everything is accepted).
"""
from __future__ import annotations

import torch


def _check(draft_tokens: torch.Tensor, target: torch.Tensor, name: str) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [g], got {tuple(draft_tokens.shape)}")
    g = draft_tokens.numel()
    if target.dim() != 2 or target.shape[0] != g + 1:
        raise ValueError(f"{name} must be [g+1, V] = [{g + 1}, V] for {g} drafts, got {tuple(target.shape)}")
    return g


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_tokens [g], target_logits [g+1, V] -> (n_accepted, next_token).

    Accept while y_k == argmax p_k; the next token is the target's argmax at the first mismatch, or the
    bonus argmax of row g when all g drafts are accepted.
    """
    g = _check(draft_tokens, target_logits, "target_logits")
    best = target_logits.argmax(dim=-1)  # [g+1]
    match = (best[:g] == draft_tokens.to(best.device)).long()  # [g]
    n = int(match.cumprod(0).sum())
    return n, int(best[n])


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    dev = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=dev))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs [V] (non-negative, not necessarily normalised) -> one index."""
    dev = generator.device if generator is not None else probs.device
    return int(torch.multinomial(probs.to(dev), 1, generator=generator))


def verify_rejection(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling. draft_tokens [g], q_probs [g, V], target_probs [g+1, V]
    -> (n_accepted, next_token).

    Left to right, accept y_k with probability min(1, p_k(y_k) / q_k(y_k)); at the first rejection the next
    token is drawn from norm(max(p_k - q_k, 0)); when all are accepted it is drawn from p_g (bonus).
    The emitted tokens are then distributed exactly as the target's own samples.
    """
    g = _check(draft_tokens, target_probs, "target_probs")
    if tuple(q_probs.shape) != (g, target_probs.shape[1]):
        raise ValueError(f"q_probs must be [{g}, {target_probs.shape[1]}], got {tuple(q_probs.shape)}")
    p = target_probs.double()  # [g+1, V]
    q = q_probs.to(p.device).double()  # [g, V]
    ys = draft_tokens.tolist()
    for k, y in enumerate(ys):
        p_y, q_y = float(p[k, y]), float(q[k, y])
        if q_y <= 0:
            raise ValueError(f"draft token {y} at position {k} has q = 0: it was not sampled from q_probs")
        # accept with prob min(1, p/q): u < p/q  <=>  u * q < p  (u in [0, 1))
        if _uniform(generator, p.device) * q_y < p_y:
            continue
        residual = (p[k] - q[k]).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had ~zero probability
            residual = p[k]
        return k, _sample(residual, generator)
    return g, _sample(p[g], generator)


# vLLM 0.33.0's rejection_sample_method values (vllm/config/speculative.py:83, :562-569) and the ones reproduced here.
REJECTION_SAMPLE_METHODS = ("standard", "block")
NOT_REPRODUCED = ("synthetic", "fly")  # lossy by design (synthetic: calibrated coin flips; fly: deferred window)


def _block_residual(p_tau: torch.Tensor, p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """max(p_tau * M_b(x) - M_s(x), 0), unnormalised (p_tau [] or [n, 1], rows [V] or [n, V]): the residual whose
    mass gives h, and what block verification resamples from at row tau."""
    return (p_tau * p_row - q_row).clamp_min(0)


def verify_block(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Block verification (Sun et al. 2024, arXiv 2403.10444) as vLLM 0.33.0 runs it for
    rejection_sample_method="block" at T > 0. draft_tokens [g], q_probs [g, V] (M_s: what each y_i was drawn from;
    one-hot for draft_sample_method=greedy), target_probs [g+1, V] (M_b) -> (n_accepted tau, next_token).

    vLLM (v1/worker/gpu/spec_decode/rejection_sampler_utils.py of 0.33.0):
      1. prefix ratios, _compute_cumulative_log_p_kernel :322-400 (:398): p_0 = 1,
             p_{i+1} = min(p_i * M_b_i(y_i) / M_s_i(y_i), 1)                    (log space: min(log p + lp - lq, 0))
      2. residual masses, _compute_local_residual_mass_kernel :403-500 (summed by _compute_global_residual_mass
         :54-97; a one-hot draft gives the closed form p (1 - M_b(y)), the same sum):
             r_{i+1} = sum_x max(p_{i+1} M_b_{i+1}(x) - M_s_{i+1}(x), 0)        for i + 1 < g
      3. _rejection_kernel :503-767, the USE_BLOCK_VERIFICATION branch :627-659: one fresh uniform u_i per draft
         position (spec_step_seed(seed, i), :597-598), and
             h_i = r_{i+1} / (r_{i+1} + 1 - p_{i+1})  (1 when that denominator is 0)   for i < g - 1
             h_{g-1} = p_g
         tau = the LAST i + 1 with u_i <= h_i (0 if none): every position is tested, an early failure does not stop
         the scan (`accepted_length = where(u <= h, i + 1, accepted_length)`).
      4. _resample_kernel :804-1016 (the block branch :925-937): tau < g draws the next token from
             norm(max(p_tau M_b_tau(x) - M_s_tau(x), 0))                       (p_0 = 1; one-hot draft: M_b_tau
         with y_tau zeroed, :951-961, the same distribution); tau == g draws the bonus token from M_b_g.
    At T = 0 vLLM takes the greedy path for every method (`if is_greedy` precedes the block branch, :599-626):
    call `verify_greedy`. Arithmetic here is float64 on probabilities (vLLM: fp32 log-probabilities), so
    decisions agree except for uniforms within rounding of a threshold.
    """
    g = _check(draft_tokens, target_probs, "target_probs")
    if tuple(q_probs.shape) != (g, target_probs.shape[1]):
        raise ValueError(f"q_probs must be [{g}, {target_probs.shape[1]}], got {tuple(q_probs.shape)}")
    p = target_probs.double()  # [g+1, V]
    q = q_probs.to(p.device).double()  # [g, V]
    ys = draft_tokens.to(p.device).long()
    rows = torch.arange(g, device=p.device)
    p_y, q_y = p[rows, ys].tolist(), q[rows, ys].tolist()  # [g] each
    ratio = [1.0]  # ratio[i] = p_i, i = 0..g
    for i in range(g):
        if q_y[i] <= 0:
            raise ValueError(f"draft token {int(ys[i])} at position {i} has q = 0: it was not sampled from q_probs")
        ratio.append(min(ratio[-1] * p_y[i] / q_y[i], 1.0))
    ratios = torch.tensor(ratio, dtype=torch.float64, device=p.device)  # [g+1]
    r = _block_residual(ratios[1:g, None], p[1:g], q[1:g]).sum(-1).tolist()  # [g-1]: r_1..r_{g-1}
    u = torch.rand(g, generator=generator, device=generator.device if generator is not None else p.device).tolist()
    tau = 0
    for i in range(g):
        if i < g - 1:
            denom = r[i] + 1.0 - ratio[i + 1]
            h = r[i] / denom if denom > 0 else 1.0
        else:
            h = ratio[g]
        if u[i] <= h:
            tau = i + 1
    if tau == g:
        return g, _sample(p[g], generator)
    residual = _block_residual(ratios[tau], p[tau], q[tau])  # [V]
    if float(residual.sum()) <= 0:  # M_s >= p_tau M_b everywhere up to rounding: a zero-probability branch
        residual = p[tau]
    return tau, _sample(residual, generator)
