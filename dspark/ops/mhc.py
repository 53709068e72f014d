"""Manifold-constrained hyper-connections (mHC), torch reference math.

DeepSeek-V4 keeps `hc` parallel residual streams per token, x [..., hc, H]. Around every block
(attention or MoE) three small mixing tensors are computed from the flattened streams:

    f = flatten(x) [..., hc*H] (fp32);  m = (f @ fn^T) * rsqrt(mean(f^2) + norm_eps)   [..., (2+hc)*hc]
    pre_j  = sigmoid(m_j * s0 + b_j) + eps                      (collapses the streams into the block input)
    post_j = 2 * sigmoid(m_{hc+j} * s1 + b_{hc+j})              (spreads the block output over the streams)
    comb   = Sinkhorn(softmax((m_{2hc:} * s2 + b_{2hc:}).view(hc, hc), -1) + eps)   (mixes the residuals)

and hc_post returns out_k = post_k * F + sum_j comb[j, k] * x_j.  The final hc_head collapses the
streams once more with its own (fn, base, scale) and no post/comb.

Everything here is computed in float32, as the reference does; the collapsed / mixed activations are
cast back to the input dtype, the mixing weights (post, comb) are returned in float32.
"""

from __future__ import annotations

import torch


def _normalised_mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Project the flattened, RMS-normalised streams onto the mixing logits.

    x [..., hc, H] -> flat [..., hc*H] fp32 -> returns [..., fn.shape[0]] fp32.
    """
    flat = x.flatten(-2).float()  # [..., hc*H]
    inv_rms = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)  # [..., 1]
    return torch.matmul(flat, fn.float().t()) * inv_rms  # [..., M]


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [..., hc, hc] logits onto (approximately) doubly stochastic matrices.

    softmax over the last axis (rows) + eps, then one column normalisation, then `iters - 1` rounds
    of (row normalisation, column normalisation), each denominator padded with `eps`.
    """
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}")
    comb = torch.softmax(comb_logits.float(), dim=-1) + eps  # [..., hc, hc]
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights_j x_j in fp32: x [..., hc, H], weights [..., hc] -> [..., H] in x.dtype."""
    return (weights.float().unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams before a block and compute the weights for hc_post.

    x [..., hc, H]; fn [(2+hc)*hc, hc*H]; base [(2+hc)*hc]; scale [3].
    Returns collapsed [..., H] (x.dtype), post [..., hc] (fp32), comb [..., hc, hc] (fp32).
    """
    hc = hc_mult
    if x.shape[-2] != hc:
        raise ValueError(f"hc_pre: expected {hc} streams on axis -2, got shape {tuple(x.shape)}")
    mix = _normalised_mix(x, fn, norm_eps)  # [..., (2+hc)*hc]
    base = base.float()
    scale = scale.float()
    pre_logit, post_logit, comb_logit = mix.split([hc, hc, hc * hc], dim=-1)
    pre_base, post_base, comb_base = base.split([hc, hc, hc * hc])

    pre = torch.sigmoid(pre_logit * scale[0] + pre_base) + eps  # [..., hc]
    post = 2.0 * torch.sigmoid(post_logit * scale[1] + post_base)  # [..., hc]
    comb_logits = (comb_logit * scale[2] + comb_base).unflatten(-1, (hc, hc))  # [..., hc, hc]
    comb = sinkhorn(comb_logits, iters, eps)
    return _collapse(x, pre), post, comb


def hc_post(
    block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a block output back to the streams: out_k = post_k F + sum_j comb[j, k] x_j.

    block_out [..., H]; residual [..., hc, H]; post [..., hc]; comb [..., hc, hc]
    -> [..., hc, H] in residual.dtype (computed in fp32).
    """
    spread = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2)  # [..., hc, H]
    mixed = torch.matmul(comb.float().transpose(-1, -2), residual.float())  # [..., hc, H]
    return (spread + mixed).to(residual.dtype)


def hc_head(
    x: torch.Tensor,
    hc_head_fn: torch.Tensor,
    hc_head_base: torch.Tensor,
    hc_head_scale: torch.Tensor,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams: x [..., hc, H] -> [..., H] (x.dtype).

    hc_head_fn [hc, hc*H], hc_head_base [hc], hc_head_scale [1].
    """
    mix = _normalised_mix(x, hc_head_fn, norm_eps)  # [..., hc]
    pre = torch.sigmoid(mix * hc_head_scale.float() + hc_head_base.float()) + eps  # [..., hc]
    return _collapse(x, pre)
