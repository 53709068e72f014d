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

`hc_pre`, `hc_post`, `hc_head` (the names the drafts call), and V4.1's `hc_pre_delayed` / `hc_collapse` (the V4.1
target's and draft's, docs/v41.md) are built from three memory-bound pieces with
explicit forward/backward, each an autograd.Function over an implementation table (torch here, tilelang
kernels in dspark.ops.kernels.mhc_tl), picked by dspark.ops.backend:
    mix      x [T, K] -> (x @ fn^T) * rsqrt(mean(x^2) + eps)   [T, M]   (K = hc*H, M = mix outputs)
    collapse x [T, hc, H], w [T, hc] -> sum_j w_j x_j           [T, H]
    post     F [T, H], x [T, hc, H], post [T, hc], comb [T, hc, hc] -> post_k F + sum_j comb[j,k] x_j
The per-token scalar math in between (sigmoids, Sinkhorn on hc x hc) stays in torch autograd: it touches
(2+hc)*hc floats per token against hc*H for the pieces. The backward saves only the inputs (plus the
[T, M] mix and [T] inverse RMS), never an fp32 copy of the streams. `*_reference` are the plain
autograd transcriptions the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark.ops.backend import resolve


@dataclass(frozen=True)
class HcSettings:
    """The mHC constants of a model: `mult` streams, `iters` Sinkhorn rounds, `eps` (pre-mix floor, Sinkhorn
    padding), `norm_eps` (the mix's RMS normalisation)."""

    mult: int
    iters: int
    eps: float
    norm_eps: float

    @classmethod
    def of(cls, config: Any) -> "HcSettings":
        """From a draft or HF config (hc_mult, hc_sinkhorn_iters, hc_eps, rms_norm_eps: the names V4's config.json
        uses)."""
        return cls(int(config.hc_mult), int(config.hc_sinkhorn_iters), float(config.hc_eps),
                   float(config.rms_norm_eps))


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


def hc_pre_reference(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, settings: HcSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams before a block and compute the weights for hc_post.

    x [..., hc, H]; fn [(2+hc)*hc, hc*H]; base [(2+hc)*hc]; scale [3].
    Returns collapsed [..., H] (x.dtype), post [..., hc] (fp32), comb [..., hc, hc] (fp32).
    """
    hc, iters, eps, norm_eps = settings.mult, settings.iters, settings.eps, settings.norm_eps
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


def hc_post_reference(
    block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a block output back to the streams: out_k = post_k F + sum_j comb[j, k] x_j.

    block_out [..., H]; residual [..., hc, H]; post [..., hc]; comb [..., hc, hc]
    -> [..., hc, H] in residual.dtype (computed in fp32).
    """
    spread = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2)  # [..., hc, H]
    mixed = torch.matmul(comb.float().transpose(-1, -2), residual.float())  # [..., hc, H]
    return (spread + mixed).to(residual.dtype)


def hc_head_reference(x: torch.Tensor, hc_head_fn: torch.Tensor, hc_head_base: torch.Tensor,
                      hc_head_scale: torch.Tensor, eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams: x [..., hc, H] -> [..., H] (x.dtype).

    hc_head_fn [hc, hc*H], hc_head_base [hc], hc_head_scale [1].
    """
    mix = _normalised_mix(x, hc_head_fn, norm_eps)  # [..., hc]
    pre = torch.sigmoid(mix * hc_head_scale.float() + hc_head_base.float()) + eps  # [..., hc]
    return _collapse(x, pre)


# ---- memory-bound pieces: torch forward/backward ---------------------------------------------------
def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def mix_fwd_torch(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K], fn [M, K] -> (mix [T, M] fp32, inv_rms [T] fp32)."""
    xf = x.to(_acc(x))
    inv = torch.rsqrt(xf.square().mean(dim=-1) + norm_eps)  # [T]
    return (xf @ fn.to(_acc(x)).t()) * inv.unsqueeze(-1), inv


def mix_bwd_torch(dmix, x, fn, mix, inv) -> tuple[torch.Tensor, torch.Tensor]:
    """dmix [T, M] -> (dx [T, K] fp32, dfn [M, K] fp32). d inv / dx = -inv^3 x / K."""
    xf = x.to(_acc(x))
    draw = dmix.to(_acc(x)) * inv.unsqueeze(-1)  # [T, M] gradient of the raw projection
    dinv = (dmix.to(_acc(x)) * mix).sum(-1) / inv  # [T] (raw = mix / inv)
    dx = draw @ fn.to(_acc(x)) - (dinv * inv.pow(3) / x.shape[-1]).unsqueeze(-1) * xf
    return dx, draw.t() @ xf


def collapse_fwd_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, hc, H], w [T, hc] -> [T, H] in x.dtype (fp32 math)."""
    return (w.to(_acc(x)).unsqueeze(-1) * x.to(_acc(x))).sum(dim=-2).to(x.dtype)


def collapse_bwd_torch(dy, x, w) -> tuple[torch.Tensor, torch.Tensor]:
    """dy [T, H] -> (dx [T, hc, H] fp32, dw [T, hc] fp32)."""
    dyf = dy.to(_acc(x)).unsqueeze(-2)  # [T, 1, H]
    return w.to(_acc(x)).unsqueeze(-1) * dyf, (dyf * x.to(_acc(x))).sum(-1)


def post_fwd_torch(f, x, post, comb) -> torch.Tensor:
    """F [T, H], x [T, hc, H], post [T, hc], comb [T, hc, hc] -> [T, hc, H] in x.dtype."""
    spread = post.to(_acc(x)).unsqueeze(-1) * f.to(_acc(x)).unsqueeze(-2)  # [T, hc, H]
    return (spread + torch.matmul(comb.to(_acc(x)).transpose(-1, -2), x.to(_acc(x)))).to(x.dtype)


def post_bwd_torch(dout, f, x, post, comb):
    """dout [T, hc, H] -> (dF [T, H], dx [T, hc, H], dpost [T, hc], dcomb [T, hc, hc]), all fp32."""
    d = dout.to(_acc(x))
    df = (post.to(_acc(x)).unsqueeze(-1) * d).sum(-2)
    dx = torch.matmul(comb.to(_acc(x)), d)  # dx_j = sum_k comb[j, k] dout_k
    dpost = (d * f.to(_acc(x)).unsqueeze(-2)).sum(-1)
    dcomb = torch.matmul(x.to(_acc(x)), d.transpose(-1, -2))  # [j, k] = <x_j, dout_k>
    return df, dx, dpost, dcomb


TORCH_OPS = {"mix_fwd": mix_fwd_torch, "mix_bwd": mix_bwd_torch, "collapse_fwd": collapse_fwd_torch,
             "collapse_bwd": collapse_bwd_torch, "post_fwd": post_fwd_torch, "post_bwd": post_bwd_torch}


def _ops(x: torch.Tensor, backend: str | None) -> dict:
    if resolve(x, backend) == "tilelang":
        from dspark.ops.kernels.mhc_tl import TILELANG_OPS

        return TILELANG_OPS
    return TORCH_OPS


class MixFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, norm_eps, ops):
        mix, inv = ops["mix_fwd"](x, fn, norm_eps)
        ctx.save_for_backward(x, fn, mix, inv)
        ctx.ops = ops
        return mix

    @staticmethod
    def backward(ctx, dmix):
        x, fn, mix, inv = ctx.saved_tensors
        dx, dfn = ctx.ops["mix_bwd"](dmix.contiguous(), x, fn, mix, inv)
        return dx.to(x.dtype), dfn.to(fn.dtype), None, None


class CollapseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ops):
        ctx.save_for_backward(x, w)
        ctx.ops = ops
        return ops["collapse_fwd"](x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = ctx.ops["collapse_bwd"](dy.contiguous(), x, w)
        return dx.to(x.dtype), dw.to(w.dtype), None


class PostFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, x, post, comb, ops):
        ctx.save_for_backward(f, x, post, comb)
        ctx.ops = ops
        return ops["post_fwd"](f, x, post, comb)

    @staticmethod
    def backward(ctx, dout):
        f, x, post, comb = ctx.saved_tensors
        df, dx, dpost, dcomb = ctx.ops["post_bwd"](dout.contiguous(), f, x, post, comb)
        return df.to(f.dtype), dx.to(x.dtype), dpost.to(post.dtype), dcomb.to(comb.dtype), None


def _tokens(x: torch.Tensor, tail: int) -> torch.Tensor:
    """[..., *tail] -> [T, *tail] contiguous."""
    return x.reshape(-1, *x.shape[x.dim() - tail:]).contiguous()


# ---- public ops (dispatching) ----------------------------------------------------------------------
def hc_mixes(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, settings: HcSettings,
    *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three mixes of an mHC sublayer: x [..., hc, H] -> (x as tokens [T, hc, H], pre [T, hc], post [T, hc],
    comb [T, hc, hc]) in the accumulation dtype (hc_post_alpha 2.0: vLLM deepseek_v4 model.py:376). hc_pre collapses
    with this sublayer's pre; V4.1's delayed pre (hc_pre_delayed) with the previous sublayer's."""
    hc, eps = settings.mult, settings.eps
    if x.shape[-2] != hc:
        raise ValueError(f"hc_pre: expected {hc} streams on axis -2, got shape {tuple(x.shape)}")
    xt = _tokens(x, 2)  # [T, hc, H]
    mix = MixFn.apply(xt.flatten(-2), fn, settings.norm_eps, _ops(x, backend))  # [T, (2+hc)*hc]
    base, scale = base.to(_acc(x)), scale.to(_acc(x))
    pre_logit, post_logit, comb_logit = mix.split([hc, hc, hc * hc], dim=-1)
    pre_base, post_base, comb_base = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_logit * scale[0] + pre_base) + eps  # [T, hc]
    post = 2.0 * torch.sigmoid(post_logit * scale[1] + post_base)  # [T, hc]
    comb = sinkhorn((comb_logit * scale[2] + comb_base).unflatten(-1, (hc, hc)), settings.iters, eps)  # [T, hc, hc]
    return xt, pre, post, comb


def hc_pre(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, settings: HcSettings,
    *, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre_reference's contract (x [..., hc, H] -> collapsed [..., H], post [..., hc], comb
    [..., hc, hc]) through the dispatched pieces."""
    lead, hc = x.shape[:-2], settings.mult
    xt, pre, post, comb = hc_mixes(x, fn, base, scale, settings, backend=backend)
    y = CollapseFn.apply(xt, pre, _ops(x, backend))  # [T, H]
    return y.view(*lead, -1), post.view(*lead, hc), comb.view(*lead, hc, hc)


def hc_pre_delayed(
    x: torch.Tensor, carried_pre: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    settings: HcSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """V4.1's "delayed" mHC pre (vLLM 0.33.0 vllm/models/deepseek_v41/nvidia/model.py:522-524; the reference
    kernels/mhc/torch.py:6-45), read by the V4.1 target (dspark.targets.v41) and the V4.1 draft alike:
    x [..., hc, H], carried_pre [..., hc] fp32 or None -> (collapsed [..., H] = sum_j carried_pre_j x_j, or
    x[..., 0, :] when None; post [..., hc]; comb [..., hc, hc]; pre [..., hc], this sublayer's pre-mix for the next
    one). The mixes are V4's (hc_mixes)."""
    lead, hc = x.shape[:-2], settings.mult
    xt, pre, post, comb = hc_mixes(x, fn, base, scale, settings)
    if carried_pre is None:
        y = xt[:, 0]  # the identity pre-mix selects stream 0 (kernels/mhc/torch.py:40-44)
    else:
        y = CollapseFn.apply(xt, _tokens(carried_pre, 1).to(pre.dtype), _ops(x, None))  # [T, H]
    return y.reshape(*lead, -1), post.view(*lead, hc), comb.view(*lead, hc, hc), pre.view(*lead, hc)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """vLLM's hc_collapse (kernels/mhc/triton.py:108): x [..., hc, H], pre [..., hc] -> sum_j pre_j x_j [..., H]
    (V4.1's final hidden: the last stream collapsed with the last FFN's pre-mix, no hc_head)."""
    lead = x.shape[:-2]
    return CollapseFn.apply(_tokens(x, 2), _tokens(pre, 1), _ops(x, None)).view(*lead, -1)


def hc_post(
    block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    *, backend: str | None = None,
) -> torch.Tensor:
    """hc_post_reference's contract: out_k = post_k F + sum_j comb[j, k] x_j, [..., hc, H] in residual.dtype."""
    hc, h = residual.shape[-2:]
    lead = residual.shape[:-2]
    out = PostFn.apply(_tokens(block_out, 1), _tokens(residual, 2), _tokens(post, 1), _tokens(comb, 2),
                       _ops(residual, backend))
    return out.view(*lead, hc, h)


def hc_head(
    x: torch.Tensor,
    hc_head_fn: torch.Tensor,
    hc_head_base: torch.Tensor,
    hc_head_scale: torch.Tensor,
    eps: float,
    norm_eps: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """hc_head_reference's contract: x [..., hc, H] -> [..., H] (x.dtype)."""
    lead = x.shape[:-2]
    ops = _ops(x, backend)
    xt = _tokens(x, 2)
    mix = MixFn.apply(xt.flatten(-2), hc_head_fn, norm_eps, ops)  # [T, hc]
    pre = torch.sigmoid(mix * hc_head_scale.to(_acc(x)) + hc_head_base.to(_acc(x))) + eps
    return CollapseFn.apply(xt, pre, ops).view(*lead, -1)
