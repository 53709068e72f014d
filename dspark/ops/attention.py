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

Packed training blocks need not spell their mask out: `PackedBlockMask(anchors, block_len, context_len, window)` is
the rule of dspark.models.block_draft.block_attention_mask (a query of block b sees context keys
max(a_b - W, 0) <= j < a_b and the slots of its own block) without the dense bool [B, A*K, S + A*K] tensor. Given one,
the reference computes each group of blocks against only the keys it can see: a contiguous context span (up to the
group's last anchor, or its window) or, when a window is shorter than that span, each block's own window gathered,
plus the block's own K keys. Its cost grows with A*K x (window or anchor position) instead of A*K x (S + A*K), and no
[A*K, A*K] block-to-block scores exist. flex_attention takes the same rule as its mask_mod (no dense tensor either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBlockMask:
    """The packed-blocks attention rule (see the module doc) as data: anchors [B, A] (long; a block whose anchor is
    0 sees no context, e.g. padding slots), block_len K, context_len S, window W (None: the whole context before the
    anchor). Keys are the S context positions followed by the A*K block slots in query order; queries are the A*K
    block slots. `shape` / `dtype` are those of the dense mask it stands for (`dense()`)."""

    anchors: torch.Tensor
    block_len: int
    context_len: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.anchors.dim() != 2:
            raise ValueError(f"PackedBlockMask: anchors must be [B, A], got {tuple(self.anchors.shape)}")
        if self.block_len < 1 or self.context_len < 0:
            raise ValueError(f"PackedBlockMask: block_len must be >= 1 and context_len >= 0, got {self.block_len}, "
                             f"{self.context_len}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"window must be positive or None, got {self.window}")

    @property
    def shape(self) -> tuple[int, int, int]:
        b, a = self.anchors.shape
        t = a * self.block_len
        return (b, t, self.context_len + t)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bool

    @property
    def device(self) -> torch.device:
        return self.anchors.device

    def to(self, device) -> "PackedBlockMask":
        return PackedBlockMask(self.anchors.to(device), self.block_len, self.context_len, self.window)

    def context_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (lo, hi) [B, A] long: block b sees context keys lo_b <= j < hi_b (an empty range when lo >= hi)."""
        hi = self.anchors.long().clamp(0, self.context_len)
        lo = torch.zeros_like(hi) if self.window is None else (self.anchors.long() - self.window).clamp(min=0)
        return lo, hi

    def dense(self) -> torch.Tensor:
        """The dense bool [B, A*K, S + A*K] mask (what block_attention_mask returns)."""
        b, t, length = self.shape
        k = self.block_len
        lo, hi = (x.repeat_interleave(k, dim=1).unsqueeze(-1) for x in self.context_bounds())  # [B, T, 1]
        j = torch.arange(self.context_len, device=self.device)
        blk = torch.arange(t, device=self.device) // k
        own = (blk.unsqueeze(1) == blk.unsqueeze(0)).expand(b, t, t)
        return torch.cat([(j >= lo) & (j < hi), own], dim=-1)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("masked_attention expects q [B,Hq,T,D], k [B,Hk,L,D], v [B,Hk,L,Dv]")
    b, hq, t, d = q.shape
    bk, hk, length, dk = k.shape
    if bk != b or dk != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"masked_attention: incompatible q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if hq % hk != 0:
        raise ValueError(f"masked_attention: query heads ({hq}) must be a multiple of kv heads ({hk})")
    if isinstance(mask, PackedBlockMask) and t % mask.block_len:
        raise ValueError(f"masked_attention: {t} queries are not whole blocks of {mask.block_len}")
    if tuple(mask.shape) != (b, t, length) or mask.dtype != torch.bool:
        raise ValueError(
            f"masked_attention: mask must be bool [{b}, {t}, {length}], got {mask.dtype} {tuple(mask.shape)}"
        )


def _softmax_weights(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """scores [..., L] (scaled, -inf where masked), sink broadcastable to [..., 1] or None -> the attention weights
    exp(s) / (sum_visible exp(s) + exp(sink)), zeros for a row with nothing visible and no sink."""
    # Row max for stability (softmax is shift invariant, so it carries no gradient).
    with torch.no_grad():
        row_max = scores.amax(dim=-1, keepdim=True)
        if sink is not None:
            row_max = torch.maximum(row_max, sink)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # masked -> 0
    denom = weights.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # empty row without sink -> zeros
    return weights / denom


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
    weights = _softmax_weights(scores, None if sink is None else sink[None, :, :, None, None])
    return torch.matmul(weights, v.unsqueeze(2))  # [B, Hk, G, t, Dv]


def _attend_blocks(q, k_ctx, v_ctx, k_blk, v_blk, lo, hi, window, scale, sink) -> torch.Tensor:
    """One group of c packed blocks, fp32: each query sees the context keys lo_b <= j < hi_b of its block b and
    the K keys of its own block.

    q [B, Hk, G, c, K, D]; k_ctx [B, Hk, S, D], v_ctx [B, Hk, S, Dv]; k_blk [B, Hk, c, K, D], v_blk [B, Hk, c, K, Dv];
    lo, hi [B, c]; sink [Hk, G] or None -> [B, Hk, G, c, K, Dv].
    """
    b, hk, g, c, kb, d = q.shape
    span_lo, span_hi = int(lo.min()), int(hi.max())  # the context keys any block of the group sees
    sink_b = None if sink is None else sink[None, :, :, None, None, None]
    s_blk = torch.matmul(q, k_blk.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, G, c, K, K]
    if span_hi <= span_lo:  # no context visible to any block of the group
        return torch.matmul(_softmax_weights(s_blk, sink_b), v_blk.unsqueeze(2))
    if window is not None and window < span_hi - span_lo:  # each block's own window, gathered: [B, c, W] keys
        idx = lo.unsqueeze(-1) + torch.arange(window, device=lo.device)  # [B, c, W]
        seen = idx < hi.unsqueeze(-1)
        idx = idx.clamp(max=k_ctx.shape[2] - 1)
        rows = torch.arange(b, device=lo.device)[:, None, None]
        k_w = k_ctx.transpose(1, 2)[rows, idx].permute(0, 3, 1, 2, 4)  # [B, Hk, c, W, D]
        v_w = v_ctx.transpose(1, 2)[rows, idx].permute(0, 3, 1, 2, 4)  # [B, Hk, c, W, Dv]
        s_ctx = torch.matmul(q, k_w.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, G, c, K, W]
        s_ctx = s_ctx.masked_fill(~seen[:, None, None, :, None, :], float("-inf"))
        w = _softmax_weights(torch.cat([s_ctx, s_blk], dim=-1), sink_b)
        return torch.matmul(w[..., :window], v_w.unsqueeze(2)) + torch.matmul(w[..., window:], v_blk.unsqueeze(2))
    # one contiguous span [span_lo, span_hi) for the whole group
    j = torch.arange(span_lo, span_hi, device=lo.device)
    seen = (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))  # [B, c, L]
    span = span_hi - span_lo
    k_s = k_ctx[:, :, span_lo:span_hi].unsqueeze(2)  # [B, Hk, 1, L, D]
    s_ctx = torch.matmul(q.reshape(b, hk, g, c * kb, d), k_s.transpose(-1, -2)).view(b, hk, g, c, kb, span) * scale
    s_ctx = s_ctx.masked_fill(~seen[:, None, None, :, None, :], float("-inf"))
    w = _softmax_weights(torch.cat([s_ctx, s_blk], dim=-1), sink_b)  # [B, Hk, G, c, K, L + K]
    out_ctx = torch.matmul(w[..., :span].reshape(b, hk, g, c * kb, span), v_ctx[:, :, span_lo:span_hi].unsqueeze(2))
    return out_ctx.view(b, hk, g, c, kb, -1) + torch.matmul(w[..., span:], v_blk.unsqueeze(2))


def _packed_attention(q, k, v, mask: "PackedBlockMask", scale: float, sink, query_chunk: int) -> torch.Tensor:
    """masked_attention for a PackedBlockMask (torch reference): blocks in groups of ~query_chunk queries."""
    b, hq, t, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    g, kb, s = hq // hk, mask.block_len, mask.context_len
    a = t // kb
    qf = q.float().reshape(b, hk, g, a, kb, d)
    kf, vf = k.float(), v.float()
    k_blk = kf[:, :, s:].reshape(b, hk, a, kb, d)
    v_blk = vf[:, :, s:].reshape(b, hk, a, kb, dv)
    lo, hi = (x.to(q.device) for x in mask.context_bounds())  # [B, A]
    sink_g = None if sink is None else sink.float().reshape(hk, g)
    per = max(1, query_chunk // kb)  # blocks per group
    attend = _attend_blocks
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        seen = (hi - lo).clamp(min=0).amax(dim=0)  # [A] keys each block (column) sees at most
        saved = 3 * 4 * b * hq * kb * int((seen + kb).sum())  # ~3 fp32 score-sized tensors autograd keeps
        if saved > RECOMPUTE_BYTES:  # keep one group's scores at a time: recomputed in the backward
            from torch.utils.checkpoint import checkpoint

            attend = lambda *xs: checkpoint(_attend_blocks, *xs, use_reentrant=False)  # noqa: E731
    outs = [attend(qf[:, :, :, i:i + per], kf[:, :, :s], vf[:, :, :s], k_blk[:, :, i:i + per],
                   v_blk[:, :, i:i + per], lo[:, i:i + per], hi[:, i:i + per], mask.window, scale, sink_g)
            for i in range(0, a, per)]
    out = torch.cat(outs, dim=3) if outs else qf.new_zeros(b, hk, g, 0, kb, dv)
    return out.reshape(b, hq, t, dv).to(q.dtype)


# Above this estimate of the scores autograd would keep for the backward, the packed path recomputes each block
# group's scores in the backward instead (torch.utils.checkpoint): memory of one group, one more forward's time.
RECOMPUTE_BYTES = 512 * 2**20

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

    q [B, Hq, T, D]; k [B, Hk, L, D]; v [B, Hk, L, Dv]; mask [B, T, L] bool (True = may attend), or a
    PackedBlockMask standing for one (then only the keys each block sees are scored);
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
    if isinstance(mask, PackedBlockMask):
        return _packed_attention(q, k, v, mask, scale, sink, query_chunk)
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
    if isinstance(mask, PackedBlockMask):  # the rule itself as the mask_mod: no dense tensor
        lo_all, hi_all = (x.to(q.device) for x in mask.context_bounds())  # [B, A]
        kb, s = mask.block_len, mask.context_len

        def visible(bi, hi, qi, ki):
            blk = qi // kb
            in_ctx = (ki >= lo_all[bi, blk]) & (ki < hi_all[bi, blk])  # hi <= S: context keys only
            return in_ctx | ((ki >= s) & ((ki - s) // kb == blk))

        has_key = None  # every query sees its own block
    else:
        dense = mask.contiguous()

        def visible(bi, hi, qi, ki):
            return dense[bi, qi, ki]

        has_key = dense.any(-1)[:, None, :, None]  # [B, 1, T, 1]

    block_mask = create_block_mask(visible, b, None, t, length, device=q.device, _compile=compiled)
    out, lse = _flex(compiled)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != hq,
                               return_lse=True)  # out [B, Hq, T, Dv], lse [B, Hq, T] (natural log)
    out = out.float()
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros_like(out))
    if sink is not None:
        keep = torch.sigmoid(lse.float() - sink.float()[None, :, None]).unsqueeze(-1)  # [B, Hq, T, 1]
        out = out * keep
    return out.to(q.dtype)
