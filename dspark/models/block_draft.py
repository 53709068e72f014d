"""The block drafts' inference path (DSpark / DFlash, docs/CONTRACTS.md §2), shared by every block-draft family.

One block of g drafts per request from the target's context features, in ONE draft forward for all requests:

    main_x = draft.combine(aux[:, :a])                 context = positions 0..a-1   [B, a, H]
    ctx    = draft.context_kv(main_x, 0..a-1)
    block  = [x0, m, ..., m] at positions a, a+1, ...  (length g "anchor", g+1 "mask"; m = config.mask_token_id)
    h      = draft.backbone(block, ctx, block_attention_mask)[pred_offset : pred_offset + g]   [B, g, H]
    U      = draft.base_logits(h)                                                            [B, g, V]
    prev_0 = x0;  logits_k = U_k + markov_head.step(prev_k, h_k) bias;  y_k ~ logits_k / T;  prev_{k+1} = y_k

It is the training forward (dspark.training.block_module builds the same blocks and the same mask), except that
the Markov head runs step by step on the draft's own samples instead of the ground truth (`forced_tokens` feeds
given tokens instead: teacher forcing). A draft without a Markov head (DFlash) samples each position from U_k.
The layout, the mask token and the attention window are the draft's config (`layout`, `mask_token_id`,
`sliding_window` with its `window_rule`, dspark.ops.attention.WINDOW_RULES: "block" sees W context keys before the
anchor from every slot, "query" is vLLM's per-query non-causal window): nothing travels down the call.

Draft-side context cache (eval; `new_cache()` -> BlockContextCache, one per request, kept by the decoding loop):
vLLM's DSpark / DFlash speculators store the context KV of every verified position once
(`precompute_and_store_context_kv`, vLLM 0.33.0 v1/worker/gpu/spec_decode/dflash/speculator.py:391 and :487, after
`prepare_context_anchor` drops the rejected rows, :201 / :225; the V1 runner the same at v1/spec_decode/dflash.py:256
and :283) and the block of the next round attends to it. Checked: tests/models/test_draft_cache.py (cached == recomputed
every round, a stale cache fails), tests/serving/test_vllm_parity.py (eval.py with the cache == vLLM step by step). With caches, a round computes
`combine` + `context_kv` only for the positions verified since the last round (x0 and the accepted drafts of the
previous round) and keeps the rest: the cache holds the context KV of positions [max(a - W, 0), a) (W =
`sliding_window`, rule "block"; [max(a - W + 1, 0), a) under rule "query"; all of 0..a-1 without a window), exactly
the keys the uncached mask lets the block see, so the block attends to the same keys. Rejected drafts never enter it (only committed positions are context), so there is
nothing to roll back after a rejection; a cache that is ahead of the request or holds other tokens is truncated to
the longest common prefix of token ids (rows depend only on positions 0..p), and recomputed where it lacks rows.

Layouts (per block at anchor position a, g = number of drafted tokens):
- "anchor" (DSpark, `sample_from_anchor=True`): inputs [x_a, m, ..., m] of length g at positions a..a+g-1;
  output row k (position a+k) predicts x_{a+k+1}.
- "mask" (DFlash, `sample_from_anchor=False`): inputs [x_a, m, ..., m] of length g+1 at positions a..a+g;
  output row k+1 (a mask at position a+k+1) predicts x_{a+k+1}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark.models.common import field_error
from dspark.models.heads import MARKOV_HEAD_KINDS
from dspark.models.proposal import Proposal, sample_from_logits
from dspark.ops.attention import PackedBlockMask, check_window

LAYOUTS = ("anchor", "mask")


def check_block_fields(cfg) -> None:
    """The fields every block draft's group has (FieldError naming the key): the taps (ascending without duplicates:
    vLLM appends them while running the target's layers in order, vllm/model_executor/models/interfaces.py:1640-1650
    and models/deepseek_v4/nvidia/model.py:993-1014 of vLLM 0.33.0, so the combiner's input blocks are ascending),
    the mask token inside the vocabulary, the Markov head kind, the layout."""
    ids = list(cfg.target_layer_ids)
    if not ids or min(ids) < 0:
        raise field_error(cfg, "target_layer_ids", f"must name at least one target layer, all >= 0, got {ids}")
    if ids != sorted(set(ids)):
        raise field_error(cfg, "target_layer_ids", f"must be ascending without duplicates (vLLM concatenates the "
                                                   f"target layers' outputs in layer order), got {ids}")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise field_error(cfg, "mask_token_id", f"{cfg.mask_token_id} outside the vocabulary [0, {cfg.vocab_size})")
    if cfg.markov_head_type not in MARKOV_HEAD_KINDS:
        raise field_error(cfg, "markov_head_type", f"must be one of {MARKOV_HEAD_KINDS}, got {cfg.markov_head_type!r}")
    if cfg.layout not in LAYOUTS:
        raise field_error(cfg, "layout", f"must be one of {LAYOUTS}, got {cfg.layout!r}")


def block_layout(layout: str, num_drafts: int) -> tuple[int, int]:
    """-> (block length, offset of the first prediction row) of a block of `num_drafts` drafts."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (num_drafts, 0) if layout == "anchor" else (num_drafts + 1, 1)


def block_attention_mask(
    anchors: torch.Tensor, block_len: int, context_len: int, window: int | None, rule: str = "block"
) -> torch.Tensor:
    """Which keys each packed block query may attend to.

    anchors: [B, A]. Keys are the `context_len` context positions followed by the A*block_len block
    slots in query order; slot i of block b sits at position a_b + i. Rule "block": a query of block b sees context
    keys j with max(a_b - W, 0) <= j < a_b (no lower bound when window is None) and every slot of its own block
    (bidirectional), nothing else. Rule "query" (vLLM's non-causal window, dspark.ops.attention): slot i sees the
    context keys j < a_b with a_b + i - j < W and the own-block slots i' with |i - i'| < W.
    Returns bool [B, A*block_len, context_len + A*block_len].
    """
    check_window(window, rule)
    B, A = anchors.shape
    T = A * block_len
    dev = anchors.device
    slot = torch.arange(T, device=dev) % block_len  # [T]
    a = anchors.repeat_interleave(block_len, dim=1).unsqueeze(-1)  # [B, T, 1]
    j = torch.arange(context_len, device=dev)  # [S]
    ctx = j < a
    if window is not None:
        ctx &= j >= (a - window if rule == "block" else a + slot.unsqueeze(-1) - window + 1)
    blk_of = torch.arange(T, device=dev) // block_len  # [T]
    own = blk_of.unsqueeze(1) == blk_of.unsqueeze(0)  # [T, T]
    if window is not None and rule == "query":
        own &= (slot.unsqueeze(1) - slot.unsqueeze(0)).abs() < window
    return torch.cat([ctx, own.expand(B, T, T)], dim=-1)


def packed_block_attention_mask(
    anchors: torch.Tensor, block_len: int, context_len: int, window: int | None, rule: str = "block"
) -> PackedBlockMask:
    """block_attention_mask's rule without its dense [B, A*block_len, context_len + A*block_len] tensor: a
    dspark.ops.attention.PackedBlockMask (same shape, `.dense()` is block_attention_mask's result), which
    masked_attention computes block group by block group over only the keys each block sees. The training forward
    uses it (its cost grows with anchors x context seen, not with the dense mask)."""
    return PackedBlockMask(anchors, int(block_len), int(context_len), window, rule)


def context_start(anchor: int, window: int | None, rule: str) -> int:
    """The first context position any slot of a block at `anchor` sees (0 without a window)."""
    if window is None:
        return 0
    return max(anchor - (window if rule == "block" else window - 1), 0)


def _check_context(aux: torch.Tensor, anchor_pos: int, num_drafts: int) -> None:
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    if aux.dim() != 3 or aux.shape[0] != 1:
        raise ValueError(f"target_feats_aux must be [1, S, n*H], got {tuple(aux.shape)}")
    if not 1 <= anchor_pos <= aux.shape[1]:
        raise ValueError(
            f"anchor_pos {anchor_pos} needs context features for positions 0..{anchor_pos - 1}, "
            f"target_feats_aux has {aux.shape[1]} positions"
        )


def _ctx_map(fn, ctx):
    """Apply fn to every tensor of a per-layer context (a list of tensors or of tuples of tensors)."""
    return [tuple(fn(t) for t in layer) if isinstance(layer, (tuple, list)) else fn(layer) for layer in ctx]


def _ctx_zip(fn, ctxs: list):
    """fn(list of the i-th tensors of every context) -> tensor, layer by layer (contexts of one structure)."""
    out = []
    for layers in zip(*ctxs):
        if isinstance(layers[0], (tuple, list)):
            out.append(tuple(fn(list(ts)) for ts in zip(*layers)))
        else:
            out.append(fn(list(layers)))
    return out


@dataclass
class BlockContextCache:
    """One request's draft-side context KV across verify rounds (module docstring): `ctx` = the draft's
    `context_kv` (batch 1, rows on the draft's `context_seq_dim`) of positions start..end-1, `ids` = the tokens
    of positions 0..end-1 they were computed from (guard and rollback point)."""

    ctx: Any = None
    start: int = 0
    ids: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return 0 if self.ids is None else int(self.ids.numel())

    @property
    def rows(self) -> int:
        return self.end - self.start

    def reusable(self, tokens: torch.Tensor, a: int) -> int:
        """How many leading positions of the cache hold the rows of `tokens` (the longest common prefix of the
        cached ids and tokens[:a]; rows depend only on the tokens at and before their position)."""
        n = min(self.end, a)
        if n == 0:
            return 0
        same = self.ids[:n] == tokens[:n].to(self.ids.device)
        return n if bool(same.all()) else int((~same).nonzero()[0, 0])


class BlockDraft:
    """Mixin of the block-draft families: their eval interface (propose_batch, new_cache) over the draft interface
    combine / context_kv / backbone / base_logits / markov_head / confidence_logit (docs/CONTRACTS.md)."""

    # dim of the position rows in each tensor of context_kv's output (V4: [B, S, D]; dense: [B, nkv, S, hd])
    context_seq_dim = 1

    def new_cache(self) -> BlockContextCache:
        """A request's draft-side context cache (propose_batch's `caches`; module docstring)."""
        return BlockContextCache()

    @torch.no_grad()
    def propose_batch(self, feats: list, tokens: list[torch.Tensor], *, num_drafts: int, temperature: float,
                      generators: list, caches: list | None = None) -> list[Proposal]:
        """One block per request i after x0 = tokens[i][-1] at position a_i = len(tokens[i]) - 1; feats[i]
        (TargetFeatures) covers positions 0..a_i-1 at least. caches: one BlockContextCache per request (kept by
        the caller across rounds; only the positions new since its last round are projected), or None: every
        round recomputes the whole context (propose_blocks, the uncached reference)."""
        if caches is not None and any(c is not None for c in caches):
            if len(caches) != len(tokens) or not all(isinstance(c, BlockContextCache) for c in caches):
                raise ValueError("propose_batch: caches must hold one BlockContextCache per request (draft.new_cache())")
            return self._propose_cached(feats, tokens, caches, num_drafts=num_drafts, temperature=temperature,
                                        generators=generators)
        anchors = [t.numel() - 1 for t in tokens]
        return self.propose_blocks([f.aux[:, :a] for f, a in zip(feats, anchors)], [int(t[-1]) for t in tokens],
                                   num_drafts=num_drafts, temperature=temperature, generators=generators)

    def _extend_caches(self, feats: list, tokens: list[torch.Tensor], caches: list[BlockContextCache]) -> list[int]:
        """Bring every cache to the context of its request: rows of positions [lo_i, a_i), lo_i = max(a_i - W, 0)
        (0 without a window). Reused rows are kept, the others are projected in ONE combine + context_kv over the
        new positions of every request (packed along the positions). -> lo_i per request."""
        window, rule = self.config.sliding_window, self.config.window_rule
        dim = self.context_seq_dim
        plans, aux_parts, pos_parts = [], [], []
        for f, t, c in zip(feats, tokens, caches):
            a = t.numel() - 1
            if a < 1 or f.aux.shape[1] < a:
                raise ValueError(f"propose_batch: x0 at position {a} needs context features of positions 0..{a - 1}, "
                                 f"got {f.aux.shape[1]}")
            lo = context_start(a, window, rule)
            hi = c.reusable(t, a)  # cached rows of positions < hi are this request's
            reuse = c.ctx is not None and c.start <= lo < hi  # the cache holds rows lo..hi-1
            first = hi if reuse else lo  # first position to project
            plans.append((a, lo, first, reuse))
            if first < a:
                aux_parts.append(f.aux[0, first:a])  # [a - first, n*H]
                pos_parts.append(torch.arange(first, a, device=f.aux.device))
        new = None
        if aux_parts:
            aux = torch.cat(aux_parts).unsqueeze(0)  # [1, N, n*H]
            new = self.context_kv(self.combine(aux), torch.cat(pos_parts).unsqueeze(0))  # per layer, N rows
        offset = 0
        for (a, lo, first, reuse), t, c in zip(plans, tokens, caches):
            parts = []
            if reuse:
                parts.append(_ctx_map(lambda x, c=c, lo=lo, first=first: x.narrow(dim, lo - c.start, first - lo), c.ctx))
            if first < a:
                parts.append(_ctx_map(lambda x, o=offset, n=a - first: x.narrow(dim, o, n), new))
                offset += a - first
            c.ctx = parts[0] if len(parts) == 1 else _ctx_zip(lambda ts: torch.cat(ts, dim=dim), parts)
            c.start, c.ids = lo, t[:a].detach().clone()
        return [lo for _, lo, _, _ in plans]

    @torch.no_grad()
    def _propose_cached(self, feats: list, tokens: list[torch.Tensor], caches: list[BlockContextCache], *,
                        num_drafts: int, temperature: float, generators: list | None) -> list[Proposal]:
        """propose_batch with draft-side context caches: the same blocks, masks and sampling as propose_blocks;
        the context keys are the cached rows [lo_i, a_i) of each request, right-padded to the longest."""
        g, bsz = int(num_drafts), len(tokens)
        if g < 1:
            raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
        if bsz == 0 or len(feats) != bsz:
            raise ValueError(f"need one TargetFeatures per request, got {len(feats)} for {bsz}")
        gens = [None] * bsz if generators is None else list(generators)
        dim = self.context_seq_dim
        self._extend_caches(feats, tokens, caches)
        lens = [c.rows for c in caches]
        width = max(lens)
        dev = feats[0].aux.device

        def padded(ts: list) -> torch.Tensor:  # per request [1, .., rows_i, ..] -> [B, .., width, ..]
            shape = list(ts[0].shape)
            shape[0], shape[dim] = bsz, width
            out = ts[0].new_zeros(shape)
            for i, x in enumerate(ts):
                out[i : i + 1].narrow(dim, 0, x.shape[dim]).copy_(x)
            return out

        ctx = caches[0].ctx if bsz == 1 else _ctx_zip(padded, [c.ctx for c in caches])
        anchors = torch.tensor([t.numel() - 1 for t in tokens], dtype=torch.long, device=dev).unsqueeze(1)  # [B, 1]
        block_ids, block_pos, block_len, pred_offset = self._block_inputs(anchors, [int(t[-1]) for t in tokens], g)
        valid = torch.arange(width, device=dev) < torch.tensor(lens, device=dev).unsqueeze(1)  # [B, S] cached rows
        ctx_mask = valid.unsqueeze(1).expand(bsz, block_len, width)  # [B, L, S]
        own = torch.ones(block_len, block_len, dtype=torch.bool, device=dev)  # [L, L]
        window = self.config.sliding_window
        if window is not None and self.config.window_rule == "query":  # slot i: positions > a + i - W, |i - i'| < W
            slot = torch.arange(block_len, device=dev)
            row_pos = torch.tensor([c.start for c in caches], device=dev).unsqueeze(1) + torch.arange(width, device=dev)
            ctx_mask = ctx_mask & (row_pos.unsqueeze(1) > (anchors + slot).unsqueeze(-1) - window)  # [B, L, S]
            own = (slot.unsqueeze(1) - slot.unsqueeze(0)).abs() < window
        mask = torch.cat([ctx_mask, own.expand(bsz, block_len, block_len)], dim=-1)  # [B, L, S+L]
        h_all = self.backbone(block_ids, block_pos, ctx, mask)  # [B, L, H]
        return self._draft_block(h_all, pred_offset, block_ids[:, 0], temperature, gens, None)

    @torch.no_grad()
    def propose_blocks(self, contexts: list[torch.Tensor], anchor_tokens: list[int], *, num_drafts: int,
                       temperature: float = 0.0, generators: list[torch.Generator | None] | None = None,
                       forced_tokens: torch.Tensor | None = None) -> list[Proposal]:
        """One block per request in ONE draft forward. contexts[i]: [1, a_i, n*H] target features of request i's
        positions 0..a_i-1; its anchor x0 = anchor_tokens[i] sits at position a_i. Contexts are right-padded to
        the longest: the block mask only lets a block see context keys before its anchor, so the padding is never
        attended (the training forward packs blocks the same way). Request i samples with generators[i], in the
        same order as alone, so batching does not change its tokens. forced_tokens: optional [B, g]."""
        cfg = self.config
        g, bsz = int(num_drafts), len(contexts)
        if bsz == 0 or len(anchor_tokens) != bsz:
            raise ValueError(f"need one anchor token per context, got {len(anchor_tokens)} for {bsz}")
        for c in contexts:
            _check_context(c, c.shape[1], g)
        gens = [None] * bsz if generators is None else list(generators)
        if forced_tokens is not None and tuple(forced_tokens.shape) != (bsz, g):
            raise ValueError(f"forced_tokens must be [{bsz}, {g}], got {tuple(forced_tokens.shape)}")
        dev = contexts[0].device
        lens = [int(c.shape[1]) for c in contexts]
        width = max(lens)
        aux = contexts[0].new_zeros(bsz, width, contexts[0].shape[-1])  # [B, A, n*H] right-padded
        for i, c in enumerate(contexts):
            aux[i, : lens[i]] = c[0]

        # ---- parallel stage: one non-causal forward over every block ----------------------------------
        main_x = self.combine(aux)  # [B, A, H]
        ctx = self.context_kv(main_x, torch.arange(width, device=dev).expand(bsz, width))
        anchors = torch.tensor(lens, dtype=torch.long, device=dev).unsqueeze(1)  # [B, 1] = a_i
        block_ids, block_pos, block_len, pred_offset = self._block_inputs(anchors, anchor_tokens, g)
        mask = block_attention_mask(anchors, block_len, width, cfg.sliding_window, cfg.window_rule)  # [B, L, A + L]
        h_all = self.backbone(block_ids, block_pos, ctx, mask)  # [B, L, H]
        return self._draft_block(h_all, pred_offset, block_ids[:, 0], temperature, gens, forced_tokens)

    def _block_inputs(self, anchors: torch.Tensor, x0: list[int], g: int):
        """anchors [B, 1] (a_i), x0 the anchor tokens -> (block ids [B, L] = [x0, m, ..., m], positions [B, L] from
        a_i, L, offset of the first prediction row) in the draft's layout."""
        block_len, pred_offset = block_layout(self.config.layout, g)
        dev = anchors.device
        block_ids = torch.full((anchors.shape[0], block_len), int(self.config.mask_token_id), dtype=torch.long,
                               device=dev)  # [B, L]
        block_ids[:, 0] = torch.tensor([int(t) for t in x0], dtype=torch.long, device=dev)
        return block_ids, anchors + torch.arange(block_len, device=dev), block_len, pred_offset

    def _draft_block(self, h_all: torch.Tensor, pred_offset: int, x0: torch.Tensor, temperature: float, gens: list,
                     forced_tokens: torch.Tensor | None) -> list[Proposal]:
        """The drafts of one block per request from the backbone output of every block row, h_all [B, L, H]
        (pre-norm; rows pred_offset.. are the prediction rows): Markov-corrected sampling (_sample_blocks) unless a
        family drafts otherwise (XPress: Jacobi passes over the whole block, anchor row included)."""
        return self._sample_blocks(h_all[:, pred_offset:], x0, temperature, gens, forced_tokens)

    def _sample_blocks(self, h: torch.Tensor, x0: torch.Tensor, temperature: float, gens: list,
                       forced_tokens: torch.Tensor | None) -> list[Proposal]:
        """Sequential stage: Markov-corrected sampling, left to right. h [B, g, H] (pre-norm), x0 [B]."""
        bsz, g = h.shape[:2]
        dev = h.device
        base = self.base_logits(h)  # [B, g, V]
        markov = self.markov_head
        has_conf = self.confidence_head is not None
        prev = x0.clone()  # [B]
        state = None
        tokens, q_rows, logit_rows, conf = [], [], [], []
        for k in range(g):
            h_k = h[:, k]  # [B, H]
            feat = None
            if markov is not None:
                bias, feat, state = markov.step(prev, h_k, state)  # [B, V], [B, r]
                logits_k = base[:, k] + bias  # [B, V]
            else:
                logits_k = base[:, k]  # [B, V]
            if has_conf:
                conf.append(self.confidence_logit(h_k, feat).float())  # [B]
            picked = [sample_from_logits(logits_k[i], temperature, gens[i]) for i in range(bsz)]
            y = torch.stack([t for t, _ in picked]).to(dev)  # [B]
            if forced_tokens is not None:
                y = forced_tokens[:, k].to(device=dev, dtype=torch.long)
            tokens.append(y)
            q_rows.append(torch.stack([q for _, q in picked]))  # [B, V]
            logit_rows.append(logits_k.float())
            prev = y
        toks, qs, lgs = torch.stack(tokens, 1), torch.stack(q_rows, 1), torch.stack(logit_rows, 1)  # [B, g(, V)]
        zs = torch.stack(conf, 1) if has_conf else None  # [B, g]
        return [Proposal(tokens=toks[i], q_probs=qs[i], conf=None if zs is None else torch.sigmoid(zs[i]),
                         logits=lgs[i], conf_logits=None if zs is None else zs[i]) for i in range(bsz)]


@torch.no_grad()
def propose(draft: BlockDraft, target_feats_aux: torch.Tensor, anchor_token: int, anchor_pos: int, *, num_drafts: int,
            temperature: float = 0.0, generator: torch.Generator | None = None,
            forced_tokens: torch.Tensor | None = None) -> Proposal:
    """One request: `num_drafts` tokens after the anchor x0 = `anchor_token` sitting at position `anchor_pos`.

    target_feats_aux: [1, S, n*H] target layer outputs with S >= anchor_pos; only positions 0..anchor_pos-1 are read
    (the anchor's own target state does not exist yet). forced_tokens: optional [g] long; when given, y_k =
    forced_tokens[k] is fed to the Markov head instead of a sample (teacher forcing), the returned logits / q_probs /
    conf are those of that path.
    """
    g, a = int(num_drafts), int(anchor_pos)
    _check_context(target_feats_aux, a, g)
    if forced_tokens is not None and tuple(forced_tokens.shape) != (g,):
        raise ValueError(f"forced_tokens must be [{g}], got {tuple(forced_tokens.shape)}")
    return draft.propose_blocks([target_feats_aux[:, :a]], [anchor_token], num_drafts=g, temperature=temperature,
                                generators=[generator],
                                forced_tokens=None if forced_tokens is None else forced_tokens.view(1, g))[0]


__all__ = ["LAYOUTS", "BlockContextCache", "BlockDraft", "block_attention_mask", "block_layout", "context_start",
           "packed_block_attention_mask", "propose"]
