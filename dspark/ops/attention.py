"""Masked softmax attention with an optional per-head sink logit (torch reference).

Shared by the DeepSeek-V4 draft (shared-KV MQA, one KV head, sink) and the dense drafts (GQA, no
sink). The mask is an explicit boolean [B, T, L] so one code path serves packed training blocks,
sliding windows and inference.

    p_{t,l} = exp(s_{t,l}) / (sum_{l visible} exp(s_{t,l}) + exp(sink_h))     s = scale * q . k
    out_t   = sum_l p_{t,l} v_l

A row with no visible key returns zeros (with or without a sink), never NaN.

Two backends compute the same numbers: the chunked torch reference below (the truth; used on CPU) and
`flex_attention` (block-sparse, compiled, used on CUDA), where the sink is folded in afterwards from the
log-sum-exp: out_sink = out * Z / (Z + e^sink) = out * sigmoid(lse - sink).
"""

from __future__ import annotations

import torch


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("masked_attention expects q [B,Hq,T,D], k [B,Hk,L,D], v [B,Hk,L,Dv]")
    b, hq, t, d = q.shape
    bk, hk, length, dk = k.shape
    if bk != b or dk != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"masked_attention: incompatible q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if hq % hk != 0:
        raise ValueError(f"masked_attention: query heads ({hq}) must be a multiple of kv heads ({hk})")
    if tuple(mask.shape) != (b, t, length) or mask.dtype != torch.bool:
        raise ValueError(
            f"masked_attention: mask must be bool [{b}, {t}, {length}], got {mask.dtype} {tuple(mask.shape)}"
        )


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sink: torch.Tensor | None
) -> torch.Tensor:
    """One query chunk, all in fp32.

    q [B, Hk, G, t, D]; k [B, Hk, L, D]; v [B, Hk, L, Dv]; mask [B, t, L]; sink [Hk, G] or None
    -> [B, Hk, G, t, Dv].
    """
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, G, t, L]
    visible = mask[:, None, None, :, :]  # [B, 1, 1, t, L]
    scores = scores.masked_fill(~visible, float("-inf"))

    # Row max for stability (softmax is shift invariant, so it carries no gradient).
    with torch.no_grad():
        row_max = scores.amax(dim=-1, keepdim=True)  # [B, Hk, G, t, 1]
        if sink is not None:
            row_max = torch.maximum(row_max, sink[None, :, :, None, None])
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))

    weights = torch.exp(scores - row_max)  # masked -> 0
    denom = weights.sum(dim=-1, keepdim=True)  # [B, Hk, G, t, 1]
    if sink is not None:
        denom = denom + torch.exp(sink[None, :, :, None, None] - row_max)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # empty row without sink -> zeros
    return torch.matmul(weights / denom, v.unsqueeze(2))  # [B, Hk, G, t, Dv]


BACKENDS = ("auto", "reference", "flex")


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sink: torch.Tensor | None = None,
    query_chunk: int = 256,
    backend: str = "auto",
) -> torch.Tensor:
    """Masked softmax attention, GQA/MQA broadcast, optional per-head sink.

    q [B, Hq, T, D]; k [B, Hk, L, D]; v [B, Hk, L, Dv]; mask [B, T, L] bool (True = may attend);
    sink [Hq] (a logit added to the softmax denominator only) or None.
    Query head h uses kv head h // (Hq // Hk). Queries are processed `query_chunk` at a time so the
    fp32 score tensor stays [B, Hq, query_chunk, L]. Returns [B, Hq, T, Dv] in q.dtype.
    """
    _check_shapes(q, k, v, mask)
    if backend not in BACKENDS:
        raise ValueError(f"masked_attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flex" or (backend == "auto" and q.is_cuda):
        return flex_masked_attention(q, k, v, mask, scale, sink, compiled=q.is_cuda)
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    b, hq, t, d = q.shape
    hk = k.shape[1]
    groups = hq // hk
    qf = q.float().reshape(b, hk, groups, t, d)  # [B, Hk, G, T, D]
    kf, vf = k.float(), v.float()
    sink_g = None if sink is None else sink.float().reshape(hk, groups)  # [Hk, G]

    chunks = []
    for start in range(0, t, query_chunk):
        stop = min(start + query_chunk, t)
        chunks.append(_attend_chunk(qf[:, :, :, start:stop], kf, vf, mask[:, start:stop], scale, sink_g))
    out = torch.cat(chunks, dim=3) if chunks else qf.new_zeros(b, hk, groups, 0, v.shape[-1])
    return out.reshape(b, hq, t, v.shape[-1]).to(q.dtype)  # [B, Hq, T, Dv]


_COMPILED_FLEX = None


def _flex(compiled: bool):
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def flex_masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    sink: torch.Tensor | None = None, compiled: bool = True,
) -> torch.Tensor:
    """Same contract as masked_attention, through torch's flex_attention with a block mask built from
    the dense boolean mask (only visible key blocks are computed). `compiled=False` runs flex in eager
    mode (slow, for checking it against the reference on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, hq, t, d = q.shape
    length = k.shape[2]
    dense = mask.contiguous()

    def visible(bi, hi, qi, ki):
        return dense[bi, qi, ki]

    block_mask = create_block_mask(visible, b, None, t, length, device=q.device, _compile=compiled)
    out, lse = _flex(compiled)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != hq,
                               return_lse=True)  # out [B, Hq, T, Dv], lse [B, Hq, T] (natural log)
    out = out.float()
    has_key = dense.any(-1)[:, None, :, None]  # [B, 1, T, 1]
    out = torch.where(has_key, out, torch.zeros_like(out))
    if sink is not None:
        keep = torch.sigmoid(lse.float() - sink.float()[None, :, None]).unsqueeze(-1)  # [B, Hq, T, 1]
        out = out * keep
    return out.to(q.dtype)
