"""Verification of a drafted chain against the target (SPEC.md 2.8). Both verifiers are lossless.

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
